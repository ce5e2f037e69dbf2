//! A small HTTP client for tests: GET a URL and read status and body.

use anyhow::{Context, Result};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// GET `url` (plain http) and return the status code and the body as text.
pub async fn get(url: &str) -> Result<(u16, String)> {
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let uri: hyper::Uri = url.parse().with_context(|| format!("bad url {url}"))?;
    let resp = tokio::time::timeout(std::time::Duration::from_secs(5), client.get(uri))
        .await
        .with_context(|| format!("GET {url} timed out"))?
        .with_context(|| format!("GET {url}"))?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}
