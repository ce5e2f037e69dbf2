//! The write RPCs: each checks its request, builds its ledger command, has the leader write it
//! ([`Service::write`]) and answers with what was written.

use std::time::Duration;

use gpuledger_ledger::{Command, Reply, pb};
use gpuledger_proto::allocator::v1 as api;
use tonic::{Request, Response, Status};

use super::Service;
use super::forward::Written;

/// The answer to a write that replies only whether it changed anything.
fn done(w: Written<api::WriteResponse>) -> Result<Response<api::WriteResponse>, Status> {
    Ok(match w {
        Written::Here(c) => Response::new(api::WriteResponse {
            seq: c.seq,
            epoch: c.epoch,
            changed: matches!(c.reply, Reply::Done { changed: true }),
        }),
        Written::There(r) => r,
    })
}

pub(super) async fn register_node(
    svc: &Service,
    req: Request<api::RegisterNodeRequest>,
) -> Result<Response<api::WriteResponse>, Status> {
    let mut inv = req
        .get_ref()
        .inventory
        .clone()
        .ok_or_else(|| Status::invalid_argument("inventory is missing"))?;
    // The cluster's unit of DRA `cores`, not the agent's: its slice publishes what is recorded.
    inv.dra_cores = svc.dra_cores.as_str().into();
    svc.write_limits
        .check_inventory(&inv, &svc.shared.metrics)?;
    done(svc.write(req, Command::RegisterNode(inv)).await?)
}

pub(super) async fn remove_node(
    svc: &Service,
    req: Request<api::RemoveNodeRequest>,
) -> Result<Response<api::WriteResponse>, Status> {
    let r = req.get_ref();
    let cmd = Command::RemoveNode {
        node: r.node.clone(),
        reason: r.reason.clone(),
    };
    done(svc.write(req, cmd).await?)
}

pub(super) async fn set_device_health(
    svc: &Service,
    req: Request<api::SetDeviceHealthRequest>,
) -> Result<Response<api::WriteResponse>, Status> {
    let r = req.get_ref();
    let cmd = Command::SetDeviceHealth(pb::DeviceHealthChanged {
        node: r.node.clone(),
        gpu_uuid: r.gpu_uuid.clone(),
        healthy: r.healthy,
        reason: r.reason.clone(),
        xid: r.xid,
    });
    done(svc.write(req, cmd).await?)
}

/// The longest a reservation may wait to be bound (the allocator's --reserve-ttl is 60 s).
const MAX_RESERVE_TTL_MS: u64 = 3_600_000;

pub(super) async fn reserve(
    svc: &Service,
    req: Request<api::ReserveRequest>,
) -> Result<Response<api::ReserveResponse>, Status> {
    let r = req.get_ref();
    if r.node.is_empty() {
        return Err(Status::invalid_argument(
            "node is empty: reserve needs the node the scheduler chose",
        ));
    }
    if r.ttl_ms > MAX_RESERVE_TTL_MS {
        return Err(Status::invalid_argument(format!(
            "ttl_ms {} is over {MAX_RESERVE_TTL_MS} (an hour): a reservation that is never bound must expire",
            r.ttl_ms
        )));
    }
    let ttl = if r.ttl_ms > 0 {
        Duration::from_millis(r.ttl_ms)
    } else {
        svc.reserve_ttl
    };
    // The reservation's time to live counts from the moment this replica took the request.
    let cmd = Command::Reserve {
        request: svc.request(r.request.clone())?,
        node: r.node.clone(),
        deadline_ms: svc.shared.clock.now_ms() + ttl.as_millis() as i64,
    };
    reserved(svc.write(req, cmd).await?)
}

pub(super) async fn adopt(
    svc: &Service,
    req: Request<api::AdoptRequest>,
) -> Result<Response<api::ReserveResponse>, Status> {
    let r = req.get_ref();
    let pod = r
        .pod
        .clone()
        .ok_or_else(|| Status::invalid_argument("pod is missing"))?;
    let cmd = Command::Adopt {
        pod,
        node: r.node.clone(),
        containers: r.containers.clone(),
        source: r.source.clone(),
    };
    reserved(svc.write(req, cmd).await?)
}

/// The answer to a write that grants (a reservation or an adoption).
fn reserved(w: Written<api::ReserveResponse>) -> Result<Response<api::ReserveResponse>, Status> {
    match w {
        Written::Here(c) => match c.reply {
            Reply::Reserved {
                allocations,
                created,
            } => Ok(Response::new(api::ReserveResponse {
                allocations,
                seq: c.seq,
                epoch: c.epoch,
                created,
            })),
            other => Err(Status::internal(format!("unexpected reply {other:?}"))),
        },
        Written::There(r) => Ok(r),
    }
}

pub(super) async fn confirm_bound(
    svc: &Service,
    req: Request<api::ConfirmBoundRequest>,
) -> Result<Response<api::WriteResponse>, Status> {
    let r = req.get_ref();
    let cmd = Command::ConfirmBound {
        pod_uid: r.pod_uid.clone(),
        node: r.node.clone(),
        reason: "confirmed by the extender".into(),
    };
    done(svc.write(req, cmd).await?)
}

pub(super) async fn assign(
    svc: &Service,
    req: Request<api::AssignRequest>,
) -> Result<Response<api::AssignResponse>, Status> {
    let r = req.get_ref();
    let cmd = Command::Assign {
        node: r.node.clone(),
        allocation_id: r.allocation_id,
        device_ids: r.device_ids.clone(),
    };
    match svc.write(req, cmd).await? {
        Written::Here(c) => match c.reply {
            Reply::Assigned(a) => Ok(Response::new(api::AssignResponse {
                allocation: Some(*a),
                seq: c.seq,
                epoch: c.epoch,
            })),
            other => Err(Status::internal(format!("unexpected reply {other:?}"))),
        },
        Written::There(r) => Ok(r),
    }
}

pub(super) async fn correct_identity(
    svc: &Service,
    req: Request<api::CorrectIdentityRequest>,
) -> Result<Response<api::WriteResponse>, Status> {
    let r = req.get_ref();
    let cmd = Command::CorrectIdentity {
        node: r.node.clone(),
        from_allocation_id: r.from_allocation_id,
        to_allocation_id: r.to_allocation_id,
        device_ids: r.device_ids.clone(),
    };
    done(svc.write(req, cmd).await?)
}

pub(super) async fn release(
    svc: &Service,
    req: Request<api::ReleaseRequest>,
) -> Result<Response<api::WriteResponse>, Status> {
    let r = req.get_ref();
    if r.pod_uid.is_empty() && r.allocation_id == 0 {
        return Err(Status::invalid_argument(
            "release needs pod_uid or allocation_id",
        ));
    }
    let cmd = Command::Release {
        pod_uid: r.pod_uid.clone(),
        container: r.container.clone(),
        allocation_id: r.allocation_id,
        reason: if r.reason.is_empty() {
            "released".into()
        } else {
            r.reason.clone()
        },
    };
    done(svc.write(req, cmd).await?)
}

pub(super) async fn report_violation(
    svc: &Service,
    req: Request<api::ReportViolationRequest>,
) -> Result<Response<api::WriteResponse>, Status> {
    let v = req
        .get_ref()
        .violation
        .clone()
        .ok_or_else(|| Status::invalid_argument("violation is missing"))?;
    done(svc.write(req, Command::ReportViolation(v)).await?)
}

pub(super) async fn set_budget(
    svc: &Service,
    req: Request<api::SetBudgetRequest>,
) -> Result<Response<api::WriteResponse>, Status> {
    let r = req.get_ref();
    let b = r
        .budget
        .clone()
        .ok_or_else(|| Status::invalid_argument("budget is missing"))?;
    if let Some(g) = svc.budget_guard_slot().get() {
        g.check_budget(&b, r.remove).await?;
    }
    let cmd = if r.remove {
        Command::RemoveBudget(pb::BudgetRemoved {
            namespace: b.namespace,
            source: b.source,
        })
    } else {
        Command::SetBudget(b)
    };
    done(svc.write(req, cmd).await?)
}

pub(super) async fn set_quota(
    svc: &Service,
    req: Request<api::SetQuotaRequest>,
) -> Result<Response<api::WriteResponse>, Status> {
    let q = req
        .get_ref()
        .quota
        .clone()
        .ok_or_else(|| Status::invalid_argument("quota is missing"))?;
    if let Some(g) = svc.budget_guard_slot().get() {
        g.check_owner(&q.namespace, "quota")?;
    }
    done(svc.write(req, Command::SetQuota(q)).await?)
}

pub(super) async fn prepare_claim(
    svc: &Service,
    req: Request<api::PrepareClaimRequest>,
) -> Result<Response<api::WriteResponse>, Status> {
    let r = req.get_ref();
    let cmd = Command::PrepareClaim {
        node: r.node.clone(),
        allocation_ids: r.allocation_ids.clone(),
        cdi_device_ids: r.cdi_device_ids.clone(),
    };
    done(svc.write(req, cmd).await?)
}

pub(super) async fn unprepare_claim(
    svc: &Service,
    req: Request<api::UnprepareClaimRequest>,
) -> Result<Response<api::WriteResponse>, Status> {
    let r = req.get_ref();
    let cmd = Command::UnprepareClaim {
        node: r.node.clone(),
        allocation_ids: r.allocation_ids.clone(),
    };
    done(svc.write(req, cmd).await?)
}

pub(super) async fn grant_claim(
    svc: &Service,
    req: Request<api::GrantClaimRequest>,
) -> Result<Response<api::WriteResponse>, Status> {
    let g = req
        .get_ref()
        .grant
        .clone()
        .ok_or_else(|| Status::invalid_argument("grant is missing"))?;
    match svc.write(req, Command::GrantClaim(g)).await? {
        Written::Here(c) => Ok(Response::new(api::WriteResponse {
            seq: c.seq,
            epoch: c.epoch,
            changed: matches!(c.reply, Reply::Reserved { created: true, .. }),
        })),
        Written::There(r) => Ok(r),
    }
}

pub(super) async fn refuse_claim(
    svc: &Service,
    req: Request<api::RefuseClaimRequest>,
) -> Result<Response<api::WriteResponse>, Status> {
    let r = req
        .get_ref()
        .refusal
        .clone()
        .ok_or_else(|| Status::invalid_argument("refusal is missing"))?;
    done(svc.write(req, Command::RefuseClaim(r)).await?)
}
