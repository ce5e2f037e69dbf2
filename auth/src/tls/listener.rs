//! A TLS listener whose handshakes run each on a task of its own, within limits on how many a
//! peer and all peers may hold, and how long one may take.

use std::sync::Arc;
use std::time::Duration;

use rustls::ServerConfig;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::Reloading;
use crate::limit::{Bites, Conn, Slots, peer_key};

/// What one TLS listener admits: handshakes and connections, in total and per peer address,
/// and how long a handshake may take.
#[derive(Debug, Clone, Copy)]
pub struct ListenerLimits {
    /// The ClientHello must arrive within this after the connection is accepted (a client
    /// sends it at once; a socket that sends nothing holds a handshake slot no longer).
    pub hello_timeout: Duration,
    /// The whole handshake must finish within this; while more than half of the handshake
    /// slots are taken, within `hello_timeout` again (an honest handshake takes milliseconds).
    pub handshake_timeout: Duration,
    /// Handshakes in progress at once.
    pub max_handshakes: usize,
    /// Handshakes in progress at once from one peer address.
    pub max_handshakes_per_peer: usize,
    /// Open connections (handshakes included) at once; 0 = no bound.
    pub max_connections: usize,
    /// Open connections at once from one peer address; 0 = no bound.
    pub max_connections_per_peer: usize,
}

impl Default for ListenerLimits {
    /// A node agent holds one connection, an extender a few, a CLI one for a moment: 256
    /// connections per address leave room for every honest client behind one address and for
    /// tests that run a whole cluster on 127.0.0.1.
    fn default() -> Self {
        ListenerLimits {
            hello_timeout: Duration::from_secs(1),
            handshake_timeout: Duration::from_secs(5),
            max_handshakes: 1024,
            max_handshakes_per_peer: 64,
            max_connections: 16_384,
            max_connections_per_peer: 256,
        }
    }
}

/// The limit names [`incoming`] counts refusals under.
pub mod bite {
    /// Every handshake slot was taken.
    pub const HANDSHAKES: &str = "tls_handshakes";
    /// The peer held as many handshake slots as one peer may.
    pub const HANDSHAKES_PER_PEER: &str = "tls_handshakes_per_peer";
    /// A ClientHello did not come in time.
    pub const HELLO_TIMEOUT: &str = "tls_hello_timeout";
    /// A handshake did not finish in time.
    pub const HANDSHAKE_TIMEOUT: &str = "tls_handshake_timeout";
    /// A client certificate of the right CA that names none of the identities admitted.
    pub const CLIENT_NAME: &str = "tls_client_name";
    /// Every connection slot was taken.
    pub const CONNECTIONS: &str = "connections";
    /// The peer held as many connections as one peer may.
    pub const CONNECTIONS_PER_PEER: &str = "connections_per_peer";
    /// An idle connection of the peer holding the most was closed to admit a peer holding
    /// fewer, the listener being full.
    pub const CONNECTIONS_EVICTED: &str = "connections_evicted";
}

/// TLS connections accepted on `listener`: each handshake runs on its own task within
/// `limits`, so a slow or silent client holds up nobody, and a connection keeps its slot of
/// the connection limits until it closes, or until the listener is full and a peer holding
/// fewer takes the slot while the connection is idle (it then ends). Refusals are counted in `bites`. Ends when the
/// stream is dropped or `stop` is cancelled.
pub fn incoming(
    listener: TcpListener,
    tls: Arc<Reloading<ServerConfig>>,
    limits: ListenerLimits,
    bites: Arc<Bites>,
    stop: CancellationToken,
) -> impl futures::Stream<Item = std::io::Result<TlsStream<Conn>>> + Send + 'static {
    let (tx, rx) = mpsc::channel(128);
    // When full, a peer holding few takes an idle connection's slot from the peer holding the
    // most: a handful of addresses cannot keep node agents and operators out. The server marks
    // a connection busy while it answers (`ConnInfo::held`).
    let connections = Slots::evicting(
        (bite::CONNECTIONS, bite::CONNECTIONS_PER_PEER),
        bite::CONNECTIONS_EVICTED,
        limits.max_connections,
        limits.max_connections_per_peer,
        bites.clone(),
    );
    let handshakes = Slots::new(
        (bite::HANDSHAKES, bite::HANDSHAKES_PER_PEER),
        limits.max_handshakes.max(1),
        limits.max_handshakes_per_peer,
        bites.clone(),
    );
    bites.declare(bite::HELLO_TIMEOUT);
    bites.declare(bite::HANDSHAKE_TIMEOUT);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                _ = stop.cancelled() => return,
                _ = tx.closed() => return,
                a = listener.accept() => a,
            };
            let (tcp, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let key = peer_key(&peer);
            // Refused at once: the socket (and its file descriptor) is closed here.
            let Ok(conn_slot) = connections.try_acquire(key) else {
                debug!(%peer, "too many connections; connection dropped");
                continue;
            };
            let Ok(slot) = handshakes.try_acquire(key) else {
                debug!(%peer, "too many TLS handshakes in progress; connection dropped");
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let busy = handshakes.in_use() > handshakes.max_total() / 2;
            let timeout = if busy {
                limits.hello_timeout.min(limits.handshake_timeout)
            } else {
                limits.handshake_timeout
            };
            let config = tls.current();
            let tx = tx.clone();
            let bites = bites.clone();
            let hello_timeout = limits.hello_timeout;
            tokio::spawn(async move {
                let _slot = slot;
                let conn = Conn::new(tcp, conn_slot, Duration::ZERO);
                let start = tokio::time::Instant::now();
                let lazy = tokio_rustls::LazyConfigAcceptor::new(
                    rustls::server::Acceptor::default(),
                    conn,
                );
                let hello = match tokio::time::timeout(hello_timeout.min(timeout), lazy).await {
                    Ok(Ok(h)) => h,
                    Ok(Err(e)) => {
                        debug!(%peer, error = %e, "TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        bites.bite(bite::HELLO_TIMEOUT);
                        debug!(%peer, "no ClientHello in time; connection cut");
                        return;
                    }
                };
                let left = timeout.saturating_sub(start.elapsed());
                match tokio::time::timeout(left, hello.into_stream(config)).await {
                    Ok(Ok(s)) => {
                        let _ = tx.send(Ok(s)).await;
                    }
                    Ok(Err(e)) => debug!(%peer, error = %e, "TLS handshake failed"),
                    Err(_) => {
                        bites.bite(bite::HANDSHAKE_TIMEOUT);
                        debug!(%peer, ?timeout, "TLS handshake timed out; connection cut");
                    }
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
