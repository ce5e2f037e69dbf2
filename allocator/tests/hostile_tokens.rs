//! ServiceAccount tokens against real allocators that review them with the (fake) API server's
//! TokenReview: an expired token, a token for another audience, a token of an account with no
//! gpuledger role and a node agent's token bound to no pod are all refused for every RPC, and
//! the ledger does not change; a valid token of the right account is served.

use std::time::Duration;

use gpuledger_auth::CredentialArgs;
use gpuledger_auth::token::AUDIENCE;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::allocators::connect;
use gpuledger_testkit::kube::{KubeStack, StackOptions};
use gpuledger_testkit::pki::NAMESPACE;
use tonic::Code;

/// A client of replica 0 of `stack` that sends `token`.
fn with_token(
    stack: &KubeStack,
    dir: &std::path::Path,
    name: &str,
    token: &str,
) -> anyhow::Result<gpuledger_testkit::allocators::Client> {
    let file = dir.join(name);
    std::fs::write(&file, token)?;
    connect(
        &stack.allocs.addrs[0],
        &CredentialArgs {
            ca: Some(stack.allocs.ids.pki.ca_file().to_path_buf()),
            token_file: Some(file),
            client_cert: None,
            client_key: None,
            server_name: None,
        },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_foreign_roleless_and_unbound_tokens_are_refused() -> anyhow::Result<()> {
    let stack = KubeStack::start(StackOptions {
        etcd_members: 1,
        allocators: 1,
        allocator_flags: vec![],
        extender_flags: None,
    })
    .await?;
    let dir = tempfile::tempdir()?;
    let store = &stack.api.store;
    let issue = |account: &str, audience: &str, ttl: u64| {
        store
            .issue_token(NAMESPACE, account, &[audience], ttl, None)
            .map_err(|e| anyhow::anyhow!("{}", e.message()))
    };
    let expired = issue("gpuledger-admin", AUDIENCE, 1)?;
    let foreign = issue("gpuledger-admin", "https://kubernetes.default.svc", 3600)?;
    let roleless = issue("default", AUDIENCE, 3600)?;
    let unbound = issue("gpuledger-node-agent", AUDIENCE, 3600)?;
    let good = issue("gpuledger-viewer", AUDIENCE, 3600)?;
    // Past its expiry (a second of lifetime, and never used before).
    tokio::time::sleep(Duration::from_millis(2100)).await;

    let mut viewer = with_token(&stack, dir.path(), "good", &good)?;
    let before = viewer.status(api::StatusRequest {}).await?.into_inner().seq;

    let cases = [
        ("expired", expired, Code::Unauthenticated),
        ("another audience", foreign, Code::Unauthenticated),
        ("no gpuledger role", roleless, Code::PermissionDenied),
        (
            "a node agent's token bound to no pod",
            unbound,
            Code::Unauthenticated,
        ),
    ];
    for (what, token, code) in cases {
        let mut c = with_token(&stack, dir.path(), what, &token)?;
        let status = c.status(api::StatusRequest {}).await;
        assert_eq!(
            status.as_ref().map_err(tonic::Status::code).err(),
            Some(code),
            "{what}: Status answered {status:?}"
        );
        let write = c
            .remove_node(api::RemoveNodeRequest {
                node: "any".into(),
                reason: "hostile".into(),
            })
            .await;
        assert_eq!(
            write.as_ref().map_err(tonic::Status::code).err(),
            Some(code),
            "{what}: RemoveNode answered {write:?}"
        );
        let dump = c.dump(api::DumpRequest {}).await;
        assert!(dump.is_err(), "{what}: Dump answered");
    }
    let after = viewer.status(api::StatusRequest {}).await?.into_inner().seq;
    assert_eq!(after, before, "refused tokens changed the ledger");
    // The valid viewer token reads.
    viewer.dump(api::DumpRequest {}).await?;
    Ok(())
}
