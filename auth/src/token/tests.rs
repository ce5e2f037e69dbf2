use std::collections::HashMap;
use std::sync::Mutex;

use super::*;

/// An API server's answers, by token, and its pods; counts the reviews it was asked for.
#[derive(Default)]
struct Cluster {
    tokens: HashMap<String, Review>,
    pods: HashMap<(String, String), (String, Option<String>)>,
    asked: Mutex<Vec<String>>,
    down: bool,
}

impl TokenReviewer for Cluster {
    fn review<'a>(
        &'a self,
        token: &'a str,
        audience: &'a str,
    ) -> BoxFuture<'a, Result<Review, Unavailable>> {
        Box::pin(async move {
            self.asked.lock().unwrap().push(token.to_string());
            if self.down {
                return Err(Unavailable("connection refused".into()));
            }
            // Let concurrent callers pile up behind one review.
            tokio::time::sleep(Duration::from_millis(20)).await;
            let mut r = self.tokens.get(token).cloned().unwrap_or(Review {
                error: "invalid bearer token".into(),
                ..Review::default()
            });
            r.audiences.retain(|a| a == audience);
            if r.audiences.is_empty() {
                r.authenticated = false;
            }
            Ok(r)
        })
    }
}

impl PodNodes for Cluster {
    fn node_of<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        uid: &'a str,
    ) -> BoxFuture<'a, Result<Option<String>, Unavailable>> {
        Box::pin(async move {
            Ok(self
                .pods
                .get(&(namespace.to_string(), name.to_string()))
                .filter(|(u, _)| u == uid)
                .and_then(|(_, n)| n.clone()))
        })
    }
}

fn jwt(exp: u64) -> String {
    let b = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
    format!(
        "{}.{}.sig",
        b(r#"{"alg":"RS256"}"#),
        b(&format!(r#"{{"aud":["gpuledger"],"exp":{exp}}}"#))
    )
}

/// A token shaped like the API server's (a JWT for gpuledger, expiring in 2096), told apart by
/// `name`.
fn named(name: &str) -> String {
    let b = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
    format!(
        "{}.{}.sig",
        b(r#"{"alg":"RS256"}"#),
        b(&format!(
            r#"{{"aud":["gpuledger"],"exp":4000000000,"n":"{name}"}}"#
        ))
    )
}

fn sa(name: &str, audiences: &[&str]) -> Review {
    Review {
        authenticated: true,
        username: format!("system:serviceaccount:gpuledger:{name}"),
        audiences: audiences.iter().map(|a| a.to_string()).collect(),
        ..Review::default()
    }
}

fn authenticator(c: Cluster) -> (Arc<Cluster>, TokenAuthenticator) {
    let c = Arc::new(c);
    let a = TokenAuthenticator::new(
        c.clone(),
        c.clone(),
        ServiceAccounts::in_namespace("gpuledger"),
        Duration::from_secs(600),
    );
    (c, a)
}

#[tokio::test]
async fn each_service_account_maps_to_its_role() {
    let mut c = Cluster::default();
    for n in [
        "gpuledger-allocator",
        "gpuledger-extender",
        "gpuledger-viewer",
        "gpuledger-admin",
    ] {
        c.tokens.insert(named(n), sa(n, &["gpuledger"]));
    }
    let (_, a) = authenticator(c);
    let role = |t: &'static str| {
        let a = &a;
        async move { a.authenticate(&named(t)).await.unwrap().unwrap().role }
    };
    assert_eq!(role("gpuledger-allocator").await, Role::Allocator);
    assert_eq!(role("gpuledger-extender").await, Role::Extender);
    assert_eq!(role("gpuledger-viewer").await, Role::Viewer);
    assert_eq!(role("gpuledger-admin").await, Role::Admin);
}

#[tokio::test]
async fn a_node_agent_is_bound_to_the_node_of_its_pod() {
    let mut c = Cluster::default();
    let mut bound = sa("gpuledger-node-agent", &["gpuledger"]);
    bound
        .extra
        .insert(POD_NAME_KEY.into(), vec!["agent-x".into()]);
    bound.extra.insert(POD_UID_KEY.into(), vec!["uid-1".into()]);
    c.tokens.insert(named("bound"), bound.clone());
    let mut stale = bound.clone();
    stale
        .extra
        .insert(POD_UID_KEY.into(), vec!["uid-old".into()]);
    c.tokens.insert(named("stale"), stale);
    c.tokens
        .insert(named("legacy"), sa("gpuledger-node-agent", &["gpuledger"]));
    c.pods.insert(
        ("gpuledger".into(), "agent-x".into()),
        ("uid-1".into(), Some("gpu-node-7".into())),
    );
    let (_, a) = authenticator(c);
    let caller = a.authenticate(&named("bound")).await.unwrap().unwrap();
    assert_eq!(caller.node(), Some("gpu-node-7"));
    assert_eq!(
        caller.subject,
        "system:serviceaccount:gpuledger:gpuledger-node-agent"
    );
    assert!(matches!(
        a.authenticate(&named("stale")).await.unwrap(),
        Err(TokenError::Unbound(_))
    ));
    assert!(matches!(
        a.authenticate(&named("legacy")).await.unwrap(),
        Err(TokenError::Unbound(_))
    ));
}

#[tokio::test]
async fn bad_tokens_other_audiences_and_other_accounts_are_refused() {
    let mut c = Cluster::default();
    c.tokens
        .insert(named("vault"), sa("gpuledger-extender", &["vault"]));
    c.tokens
        .insert(named("default"), sa("default", &["gpuledger"]));
    let mut other_ns = sa("gpuledger-admin", &["gpuledger"]);
    other_ns.username = "system:serviceaccount:tenant-a:gpuledger-admin".into();
    c.tokens.insert(named("other-ns"), other_ns);
    let (_, a) = authenticator(c);
    assert!(matches!(
        a.authenticate(&named("nonsense")).await.unwrap(),
        Err(TokenError::Invalid(_))
    ));
    assert!(matches!(
        a.authenticate(&named("vault")).await.unwrap(),
        Err(TokenError::Invalid(_))
    ));
    let e = a
        .authenticate(&named("default"))
        .await
        .unwrap()
        .unwrap_err();
    assert!(matches!(e, TokenError::NoRole(..)), "{e}");
    assert!(
        e.to_string()
            .contains("system:serviceaccount:gpuledger:default")
    );
    assert!(matches!(
        a.authenticate(&named("other-ns")).await.unwrap(),
        Err(TokenError::NoRole(..))
    ));
}

#[tokio::test]
async fn one_review_per_token_however_many_concurrent_calls() {
    let exp = now_unix() + 3600;
    let token = jwt(exp);
    let mut c = Cluster::default();
    c.tokens
        .insert(token.clone(), sa("gpuledger-extender", &["gpuledger"]));
    let (c, a) = authenticator(c);
    let calls = (0..50).map(|_| a.authenticate(&token));
    for v in futures::future::join_all(calls).await {
        assert_eq!(v.unwrap().unwrap().role, Role::Extender);
    }
    a.authenticate(&token).await.unwrap().unwrap();
    assert_eq!(c.asked.lock().unwrap().len(), 1);
    assert_eq!(a.reviews(), 1);
}

#[tokio::test]
async fn an_unreachable_api_server_is_not_remembered() {
    let (c, a) = authenticator(Cluster {
        down: true,
        ..Cluster::default()
    });
    assert!(a.authenticate(&named("t")).await.is_err());
    assert!(a.authenticate(&named("t")).await.is_err());
    assert_eq!(c.asked.lock().unwrap().len(), 2, "each call asks again");
}

#[test]
fn the_expiry_bounds_the_cache_lifetime() {
    let now = 1_000_000;
    assert_eq!(
        ttl_until_expiry(&jwt(now + 90), now),
        Some(Duration::from_secs(90))
    );
    assert_eq!(ttl_until_expiry(&jwt(now - 5), now), Some(Duration::ZERO));
    assert_eq!(ttl_until_expiry("opaque-token", now), None);
    assert_eq!(ttl_until_expiry("a.!!!.c", now), None);
}

#[tokio::test]
async fn tokens_no_api_server_would_accept_are_refused_without_a_review() {
    let (c, a) = authenticator(Cluster::default());
    let b = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
    let now = now_unix();
    let other_audience = format!(
        "{}.{}.sig",
        b("{}"),
        b(&format!(r#"{{"aud":["vault"],"exp":{}}}"#, now + 60))
    );
    for junk in [
        "opaque".to_string(),
        "a.b".into(),
        "a.!!!.c".into(),
        other_audience,
        jwt(now - 3600),
    ] {
        assert!(
            matches!(
                a.authenticate(&junk).await.unwrap(),
                Err(TokenError::Invalid(_))
            ),
            "{junk}"
        );
    }
    assert_eq!(c.asked.lock().unwrap().len(), 0, "no review for junk");
    assert_eq!(
        plausible(&jwt(now - 10), now),
        Ok(()),
        "clock skew is tolerated"
    );
}

#[tokio::test]
async fn a_peer_whose_tokens_keep_failing_gets_no_more_reviews() {
    let mut c = Cluster::default();
    c.tokens
        .insert(named("good"), sa("gpuledger-viewer", &["gpuledger"]));
    let (c, a) = authenticator(c);
    let bites = Bites::new();
    let a = a.with_failure_limit(3, bites.clone());
    let (bad, honest): (IpAddr, IpAddr) =
        ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
    // Its valid token, reviewed before the flood, stays good.
    a.authenticate_from(&named("good"), Some(bad))
        .await
        .unwrap()
        .unwrap();
    for i in 0..3 {
        let v = a
            .authenticate_from(&named(&format!("forged-{i}")), Some(bad))
            .await;
        assert!(matches!(v, Ok(Err(TokenError::Invalid(_)))), "{v:?}");
    }
    let v = a.authenticate_from(&named("forged-3"), Some(bad)).await;
    assert!(
        matches!(v, Err(Unreviewed::Throttled(p)) if p == bad),
        "{v:?}"
    );
    assert_eq!(
        c.asked.lock().unwrap().len(),
        4,
        "the fourth forgery cost no review"
    );
    assert_eq!(bites.count(BITE_FAILED_REVIEWS), 1);
    a.authenticate_from(&named("good"), Some(bad))
        .await
        .unwrap()
        .unwrap();
    // Another address is reviewed as before.
    let v = a.authenticate_from(&named("forged-4"), Some(honest)).await;
    assert!(matches!(v, Ok(Err(TokenError::Invalid(_)))), "{v:?}");
}
