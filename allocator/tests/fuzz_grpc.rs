//! The fuzzing tier over the gRPC messages the allocator decodes: every write and placement
//! request, from random bytes and from mutations of real encodings, decoded as the service
//! decodes it, checked by the same functions (the request's validation, the inventory limits,
//! the authorization facts) and, where it decodes, decided by the ledger against a small state.
//! None may panic, and none may reach an invariant violation (which ends a leadership).

use gpuledger_allocator::authz::Touches;
use gpuledger_allocator::metrics::Metrics;
use gpuledger_allocator::write_limits::WriteLimits;
use gpuledger_ledger::{Command, CommandError, Ledger, pb, placement};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::fuzz::{self, bytes_like};
use gpuledger_testkit::workload::{inventory, pod};
use prost::Message;

/// A ledger with two nodes, one pod reserved.
fn seeded() -> Ledger {
    let mut l = Ledger::new();
    for n in ["n1", "n2"] {
        l.execute(Command::RegisterNode(inventory(n, 2, 16_000, "T4")), 1, 1)
            .expect("registers");
    }
    let r = gpuledger_allocator::service::pod_request(Some(pod("u1", 1_000, 10)))
        .expect("a valid request");
    l.execute(
        Command::Reserve {
            request: r,
            node: "n1".into(),
            deadline_ms: 10_000,
        },
        1,
        2,
    )
    .expect("reserves");
    l
}

/// Valid encodings of every request, to mutate.
fn samples() -> Vec<Vec<u8>> {
    let v = pb::LimitViolated {
        allocation_id: 3,
        node: "n1".into(),
        gpu_uuid: "GPU-n1-0".into(),
        pid: 7,
        used_mib: 2_000,
        limit_mib: 1_000,
        action: "kill".into(),
    };
    vec![
        api::RegisterNodeRequest {
            inventory: Some(inventory("n1", 2, 16_000, "T4")),
        }
        .encode_to_vec(),
        api::ReserveRequest {
            request: Some(pod("u2", 2_000, 20)),
            node: "n2".into(),
            ttl_ms: 1_000,
        }
        .encode_to_vec(),
        api::FilterRequest {
            request: Some(pod("u3", 1_000, 0)),
            nodes: vec!["n1".into(), "n2".into()],
        }
        .encode_to_vec(),
        api::ReportViolationRequest { violation: Some(v) }.encode_to_vec(),
        api::AssignRequest {
            node: "n1".into(),
            allocation_id: 3,
            device_ids: vec!["GPU-n1-0::0".into()],
        }
        .encode_to_vec(),
        api::ReleaseRequest {
            pod_uid: "u1".into(),
            reason: "done".into(),
            ..Default::default()
        }
        .encode_to_vec(),
    ]
}

fn decide(l: &mut Ledger, cmd: Command) {
    if let Err(CommandError::Bug(e)) = l.execute(cmd.clone(), 1, 3) {
        panic!("{cmd:?} reached an invariant violation: {e}");
    }
}

#[test]
fn fuzz_grpc_requests() {
    let base = seeded();
    let limits = WriteLimits::default();
    let metrics = Metrics::default();
    fuzz::run("gRPC requests", bytes_like(samples()), |b| {
        let mut l = base.clone();
        if let Ok(r) = api::RegisterNodeRequest::decode(b.as_slice()) {
            let _ = r.facts(&l);
            if let Some(inv) = r.inventory
                && limits.check_inventory(&inv, &metrics).is_ok()
            {
                decide(&mut l, Command::RegisterNode(inv));
            }
        }
        if let Ok(r) = api::ReserveRequest::decode(b.as_slice())
            && let Ok(request) = gpuledger_allocator::service::pod_request(r.request)
        {
            let node = r.node;
            decide(
                &mut l,
                Command::Reserve {
                    request,
                    node,
                    deadline_ms: 10_000,
                },
            );
        }
        if let Ok(r) = api::FilterRequest::decode(b.as_slice())
            && let Ok(request) = gpuledger_allocator::service::pod_request(r.request)
        {
            let f = placement::filter_nodes(&l, &r.nodes, &request);
            for n in f.fits {
                let _ = l.node(&n).map(|ns| placement::score_node(ns, &request));
            }
        }
        if let Ok(r) = api::ReportViolationRequest::decode(b.as_slice()) {
            let _ = r.facts(&l);
            if let Some(v) = r.violation {
                decide(&mut l, Command::ReportViolation(v));
            }
        }
        if let Ok(r) = api::AssignRequest::decode(b.as_slice()) {
            let _ = r.facts(&l);
            decide(
                &mut l,
                Command::Assign {
                    node: r.node,
                    allocation_id: r.allocation_id,
                    device_ids: r.device_ids,
                },
            );
        }
        if let Ok(r) = api::CorrectIdentityRequest::decode(b.as_slice()) {
            let _ = r.facts(&l);
            decide(
                &mut l,
                Command::CorrectIdentity {
                    node: r.node,
                    from_allocation_id: r.from_allocation_id,
                    to_allocation_id: r.to_allocation_id,
                    device_ids: r.device_ids,
                },
            );
        }
        if let Ok(r) = api::ReleaseRequest::decode(b.as_slice()) {
            let _ = r.facts(&l);
            decide(
                &mut l,
                Command::Release {
                    pod_uid: r.pod_uid,
                    container: r.container,
                    allocation_id: r.allocation_id,
                    reason: r.reason,
                },
            );
        }
        if let Ok(r) = api::ConfirmBoundRequest::decode(b.as_slice()) {
            decide(
                &mut l,
                Command::ConfirmBound {
                    pod_uid: r.pod_uid,
                    node: r.node,
                    reason: "fuzz".into(),
                },
            );
        }
        if let Ok(r) = api::SetQuotaRequest::decode(b.as_slice())
            && let Some(q) = r.quota
        {
            decide(&mut l, Command::SetQuota(q));
        }
        if let Ok(r) = api::SetBudgetRequest::decode(b.as_slice())
            && let Some(budget) = r.budget
        {
            decide(&mut l, Command::SetBudget(budget));
        }
        // Whatever was decided leaves a state that holds its invariants.
        if let Err(e) = l.check() {
            panic!("the state breaks an invariant: {e}");
        }
    });
}
