use std::net::SocketAddr;

use axum::routing::get;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::*;

/// A TCP connection to `to` from the loopback address `source`.
async fn tcp_from(source: [u8; 4], to: SocketAddr) -> io::Result<TcpStream> {
    let s = tokio::net::TcpSocket::new_v4()?;
    s.bind(SocketAddr::from((source, 0)))?;
    s.connect(to).await
}

/// Whether the server closed `s` (end of stream or reset) within `wait`.
async fn closed(s: &mut (impl AsyncRead + Unpin), wait: Duration) -> bool {
    matches!(
        tokio::time::timeout(wait, s.read(&mut [0u8; 64])).await,
        Ok(Ok(0) | Err(_))
    )
}

/// GET /healthz on `s`: the status line.
async fn healthz(s: &mut (impl AsyncRead + AsyncWrite + Unpin)) -> String {
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut answer)).await;
    String::from_utf8_lossy(&answer)
        .lines()
        .next()
        .unwrap_or("")
        .to_string()
}

fn app() -> Router {
    Router::new().route("/healthz", get(|| async { "ok" }))
}

#[tokio::test]
async fn the_plain_port_bounds_connections_evicts_idle_ones_and_times_out_heads() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let bites = Bites::new();
    let stop = CancellationToken::new();
    let limits = Limits::plain(8, 2, Duration::from_millis(700));
    tokio::spawn(serve_plain(
        "test",
        listener,
        limits,
        bites.clone(),
        app(),
        stop.clone(),
    ));
    // Per peer: the third connection from one address is closed at once.
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(tcp_from([127, 0, 0, 2], addr).await.unwrap());
    }
    assert!(closed(&mut held[2], Duration::from_millis(300)).await);
    held.pop();
    // Four more addresses fill the port.
    for source in 3..6 {
        for _ in 0..2 {
            held.push(tcp_from([127, 0, 0, source], addr).await.unwrap());
        }
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    // A newcomer still gets in: an idle connection of a peer holding more is closed for it.
    let mut probe = tcp_from([127, 0, 0, 9], addr).await.unwrap();
    assert_eq!(healthz(&mut probe).await, "HTTP/1.1 200 OK");
    // A connection that sends no request is closed after the header read timeout.
    let mut all_closed = true;
    for s in &mut held {
        all_closed &= closed(s, Duration::from_secs(2)).await;
    }
    assert!(all_closed, "idle connections still open");
    assert!(bites.count(bite::HTTP_CONNECTIONS_PER_PEER) >= 1);
    assert_eq!(bites.count(bite::HTTP_CONNECTIONS_EVICTED), 1);
    stop.cancel();
}

/// Regression (hostile load II): a handful of addresses held every connection of the
/// webhook, and the API server's next connection was refused.
#[tokio::test]
async fn a_handful_of_tls_peers_cannot_fill_the_listener() {
    let dir = tempfile::tempdir().unwrap();
    let ca = crate::pki::Ca::new("test-ca").unwrap();
    let ca_file = dir.path().join("ca.pem");
    ca.write(&ca_file).unwrap();
    let (cert, key) = ca
        .server(&["localhost"])
        .unwrap()
        .write(dir.path(), "server")
        .unwrap();
    let tls = crate::tls::server_config(&cert, &key, crate::tls::ClientCerts::None, &[b"http/1.1"])
        .unwrap();
    let client = crate::tls::client_config(&ca_file, None, &[b"http/1.1"]).unwrap();
    let connector = tokio_rustls::TlsConnector::from(client.current());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let bites = Bites::new();
    let stop = CancellationToken::new();
    let limits = Limits {
        max_connections: 40,
        max_connections_per_peer: 16,
        ..Limits::default()
    };
    tokio::spawn(serve(
        "test",
        listener,
        tls,
        limits,
        bites.clone(),
        app(),
        stop.clone(),
    ));
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let connect = |source: [u8; 4]| {
        let (connector, name) = (connector.clone(), name.clone());
        async move {
            let tcp = tcp_from(source, addr).await?;
            connector.connect(name, tcp).await
        }
    };
    // Two addresses at the per-peer limit, then a few at one connection each, until the
    // listener refuses them: every slot is taken, by idle TLS connections.
    let mut held = Vec::new();
    for source in [2, 3] {
        for _ in 0..16 {
            held.push(connect([127, 0, 0, source]).await.unwrap());
        }
    }
    for source in 4..20 {
        let Ok(mut s) = connect([127, 0, 0, source]).await else {
            continue;
        };
        if closed(&mut s, Duration::from_millis(50)).await {
            continue;
        }
        held.push(s);
    }
    let full = bites.count(tls_bite::CONNECTIONS) + bites.count(bite::CONNECTIONS_EVICTED);
    assert!(full >= 1, "the listener never filled");
    // The API server, holding nothing, is answered.
    for source in 30..33 {
        let mut s = connect([127, 0, 0, source]).await.unwrap();
        assert_eq!(healthz(&mut s).await, "HTTP/1.1 200 OK");
    }
    assert!(bites.count(bite::CONNECTIONS_EVICTED) >= 3);
    stop.cancel();
}
