//! `/healthz` (the process answers) and `/readyz` (registered with the kubelet and following
//! the ledger) over plain HTTP/1.1, for the DaemonSet's probes.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tracing::warn;

use crate::agent::Agent;

/// The status line and body for a request path.
pub fn answer(path: &str, registered: bool, synced: bool) -> (&'static str, String) {
    match path {
        "/healthz" => ("200 OK", "ok\n".into()),
        "/readyz" if registered && synced => ("200 OK", "ready\n".into()),
        "/readyz" => (
            "503 Service Unavailable",
            format!("not ready: kubelet_registered={registered} ledger_synced={synced}\n"),
        ),
        _ => ("404 Not Found", "not found\n".into()),
    }
}

/// Serve the probes on `addr` forever.
pub async fn serve(agent: Arc<Agent>, addr: SocketAddr) {
    let l = match TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) => {
            warn!(%addr, "health endpoint not served: {e}");
            return;
        }
    };
    loop {
        let Ok((mut s, _)) = l.accept().await else {
            continue;
        };
        let agent = agent.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 1024];
            let mut n = 0;
            while n < buf.len() && !buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                match s.read(&mut buf[n..]).await {
                    Ok(0) | Err(_) => break,
                    Ok(k) => n += k,
                }
            }
            let req = String::from_utf8_lossy(&buf[..n]);
            let path = req.split_whitespace().nth(1).unwrap_or("/");
            let (status, body) = answer(
                path,
                agent.kubelet_registered.load(Ordering::Acquire),
                agent.synced(),
            );
            let resp = format!(
                "HTTP/1.1 {status}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = s.write_all(resp.as_bytes()).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_registered_and_synced() {
        assert_eq!(answer("/healthz", false, false).0, "200 OK");
        assert_eq!(answer("/readyz", true, true).0, "200 OK");
        assert!(answer("/readyz", true, false).0.starts_with("503"));
        assert!(answer("/readyz", false, true).0.starts_with("503"));
        assert!(answer("/metrics", true, true).0.starts_with("404"));
    }
}
