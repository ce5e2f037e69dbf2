//! `pods/{name}/portforward` for the fake API server, over the websocket protocol kube-rs (and
//! kubectl ≥ 1.30) speak.
//!
//! The protocol (`v4.channel.k8s.io`, as kube-rs negotiates it for port-forward): for the i-th
//! port of `?ports=a,b`, channel 2i carries data and 2i+1 errors. Each websocket message is one
//! binary frame `[channel, payload…]`. The server opens every channel with a frame holding the
//! port as two little-endian bytes; after that, data frames go both ways on the even channels
//! and the server may send one UTF-8 error message on an odd channel, after which the port is
//! unusable. Closing the websocket ends everything.
//!
//! The fake forwards to the pod's `status.podIP` when it is a loopback address and to
//! 127.0.0.1 otherwise: the "pods" are local processes and nothing leaves 127.0.0.0/8.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::{SinkExt, StreamExt};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;

use super::store::Store;

/// The websocket subprotocol served (kube-rs offers v5 and v4; v5 only adds stream close,
/// which port-forward does not use).
pub const SUBPROTOCOL: &str = "v4.channel.k8s.io";

/// Connections forwarded to a pod since the process started (tests check traffic went here).
static FORWARDED: AtomicU64 = AtomicU64::new(0);

/// How many port-forward connections to pods the fake API servers of this process have opened.
pub fn forwarded_connections() -> u64 {
    FORWARDED.load(Ordering::Relaxed)
}

/// The port-forward route, to merge into the fake API server's router.
pub fn routes(store: Arc<Store>) -> Router {
    Router::new()
        .route(
            "/api/v1/namespaces/{namespace}/pods/{name}/portforward",
            axum::routing::get(portforward).post(portforward),
        )
        .with_state(store)
}

fn status(code: u16, reason: &str, message: String) -> Response {
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                      "message": message, "reason": reason, "code": code});
    let code = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (code, axum::Json(body)).into_response()
}

fn header_str(req: &Request, name: header::HeaderName) -> &str {
    req.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

async fn portforward(
    State(store): State<Arc<Store>>,
    Path((namespace, name)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
    mut req: Request,
) -> Response {
    let pod = match store.get("v1", "pods", &namespace, &name) {
        Ok(p) => p,
        Err(_) => return status(404, "NotFound", format!("pods \"{name}\" not found")),
    };
    let phase = pod.pointer("/status/phase").and_then(Value::as_str);
    if phase != Some("Running") {
        return status(
            400,
            "BadRequest",
            format!("pod {name} is not running (phase {phase:?}); cannot forward ports"),
        );
    }
    let mut ports = Vec::new();
    for p in q.get("ports").map_or("", String::as_str).split(',') {
        match p.trim().parse::<u16>() {
            Ok(n) if n > 0 => ports.push(n),
            _ => {
                return status(
                    400,
                    "BadRequest",
                    format!("invalid port {p:?} in ports={:?}", q.get("ports")),
                );
            }
        }
    }
    if ports.is_empty() || ports.len() > 64 {
        return status(400, "BadRequest", "name 1 to 64 ports in ?ports=".into());
    }
    if !header_str(&req, header::UPGRADE).eq_ignore_ascii_case("websocket") {
        return status(
            400,
            "BadRequest",
            "port-forward needs a websocket upgrade (the fake does not speak SPDY)".into(),
        );
    }
    let offered = header_str(&req, header::SEC_WEBSOCKET_PROTOCOL);
    if !offered.split(',').any(|p| p.trim() == SUBPROTOCOL) {
        return status(
            400,
            "BadRequest",
            format!("websocket subprotocols {offered:?} offered; the fake serves {SUBPROTOCOL}"),
        );
    }
    let Some(accept) = req
        .headers()
        .get(header::SEC_WEBSOCKET_KEY)
        .map(|k| derive_accept_key(k.as_bytes()))
    else {
        return status(400, "BadRequest", "Sec-WebSocket-Key is missing".into());
    };
    let ip = pod
        .pointer("/status/podIP")
        .and_then(Value::as_str)
        .and_then(|s| s.parse::<IpAddr>().ok())
        .filter(IpAddr::is_loopback)
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    let upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        if let Ok(up) = upgrade.await {
            let ws = WebSocketStream::from_raw_socket(TokioIo::new(up), Role::Server, None).await;
            forward(ws, ip, ports).await;
        }
    });
    let mut r = StatusCode::SWITCHING_PROTOCOLS.into_response();
    let h = r.headers_mut();
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    h.insert(
        header::SEC_WEBSOCKET_PROTOCOL,
        HeaderValue::from_static(SUBPROTOCOL),
    );
    if let Ok(v) = HeaderValue::from_str(&accept) {
        h.insert(header::SEC_WEBSOCKET_ACCEPT, v);
    }
    r
}

/// Pump one websocket against TCP connections to `ip`:`ports` until either side closes.
async fn forward<S>(ws: WebSocketStream<S>, ip: IpAddr, ports: Vec<u16>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sink, mut stream) = ws.split();
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Message>(64);
    let mut writers = Vec::with_capacity(ports.len());
    let mut readers = JoinSet::new();
    for (i, &port) in ports.iter().enumerate() {
        let data = (2 * i) as u8;
        let [lo, hi] = port.to_le_bytes();
        for ch in [data, data + 1] {
            if sink.send(Message::binary(vec![ch, lo, hi])).await.is_err() {
                return;
            }
        }
        match TcpStream::connect((ip, port)).await {
            Ok(conn) => {
                FORWARDED.fetch_add(1, Ordering::Relaxed);
                let _ = conn.set_nodelay(true);
                let (mut r, w) = conn.into_split();
                writers.push(Some(w));
                let tx = tx.clone();
                readers.spawn(async move {
                    let mut buf = vec![0u8; 32 * 1024];
                    buf[0] = data;
                    loop {
                        match r.read(&mut buf[1..]).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => {
                                if tx.send(Message::binary(buf[..=n].to_vec())).await.is_err() {
                                    return;
                                }
                            }
                        }
                    }
                });
            }
            Err(e) => {
                writers.push(None);
                let mut msg = vec![data + 1];
                msg.extend_from_slice(
                    format!("error forwarding port {port} to pod: dial {ip}:{port}: {e}")
                        .as_bytes(),
                );
                if sink.send(Message::binary(msg)).await.is_err() {
                    return;
                }
            }
        }
    }
    drop(tx);
    // Everything the pods send goes out through one writer; it closes the websocket when every
    // pod connection has ended.
    let writer = tokio::spawn(async move {
        while let Some(m) = rx.recv().await {
            if sink.send(m).await.is_err() {
                return;
            }
        }
        // close() rather than send(Close): after the peer's close it flushes the queued reply.
        let _ = sink.close().await;
    });
    while let Some(Ok(msg)) = stream.next().await {
        match msg {
            Message::Binary(b) if b.len() > 1 && b[0] % 2 == 0 => {
                let i = usize::from(b[0] / 2);
                if let Some(Some(w)) = writers.get_mut(i)
                    && w.write_all(&b[1..]).await.is_err()
                {
                    writers[i] = None;
                }
            }
            Message::Close(_) => break,
            _ => {}
        }
    }
    // The client is gone: end the pod connections, then let the writer answer the close (a
    // websocket dropped without the closing handshake is an error to kube-rs).
    for w in writers.iter_mut().flatten() {
        let _ = w.shutdown().await;
    }
    readers.shutdown().await;
    let _ = tokio::time::timeout(std::time::Duration::from_secs(2), writer).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// kube-rs's own port-forward client against this endpoint, to a local echo server.
    #[tokio::test]
    async fn kube_rs_forwards_through_the_fake() -> anyhow::Result<()> {
        use k8s_openapi::api::core::v1::Pod;
        let echo = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = echo.local_addr()?.port();
        tokio::spawn(async move {
            while let Ok((mut c, _)) = echo.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = c.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        let dir = tempfile::tempdir()?;
        let api = super::super::FakeApiServer::start(dir.path()).await?;
        api.add_pod(json!({
            "metadata": {"name": "echo", "namespace": "ns"},
            "status": {"phase": "Running", "podIP": "127.0.0.1"},
        }))?;
        let pods: kube::Api<Pod> = kube::Api::namespaced(api.client().await?, "ns");
        let before = forwarded_connections();
        let mut pf = pods.portforward("echo", &[port]).await?;
        let mut s = pf.take_stream(port).expect("the port's stream");
        s.write_all(b"hello through the fake").await?;
        let mut got = vec![0u8; 22];
        s.read_exact(&mut got).await?;
        assert_eq!(&got, b"hello through the fake");
        assert!(forwarded_connections() > before);
        drop(s);
        pf.join().await?;

        // A port nobody listens on: the error channel says so.
        let closed = crate::free_port()?;
        let mut pf = pods.portforward("echo", &[closed]).await?;
        let err = pf.take_error(closed).expect("the port's errors").await;
        assert!(
            err.as_deref()
                .is_some_and(|e| e.contains("error forwarding port")),
            "{err:?}"
        );
        // A pod that is not running cannot be forwarded to.
        api.add_pod(json!({"metadata": {"name": "pending", "namespace": "ns"}}))?;
        assert!(pods.portforward("pending", &[port]).await.is_err());
        Ok(())
    }
}
