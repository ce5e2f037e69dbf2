//! Admitting a GPU container the way the kubelet's device manager does: how many devices it
//! asks for, then Allocate at admission and PreStartContainer at start, each retried while
//! the node agent may be restarting.

use std::time::{Duration, Instant};

use anyhow::Result;
use k8s_openapi::api::core::v1::Container;
use tokio_util::sync::CancellationToken;

use super::NodeCtx;
use crate::history::{Outcome, PodAt};
use crate::kubelet::Allocated;

/// Device count a container asks of the device plugin: `gpuledger.io/gpu`, or 1 when it asks
/// for GPU memory or compute without a count (what the admission webhook adds).
pub fn gpu_count(c: &Container) -> usize {
    let Some(r) = c.resources.as_ref() else {
        return 0;
    };
    let maps = [r.limits.as_ref(), r.requests.as_ref()];
    let get = |k: &str| {
        maps.iter()
            .flatten()
            .find_map(|m| m.get(k))
            .map(|q| q.0.clone())
    };
    if let Some(n) = get("gpuledger.io/gpu") {
        return n.trim().parse().unwrap_or(1);
    }
    let gpuish = [
        "gpuledger.io/gpu-mem",
        "gpuledger.io/gpu-mem-percent",
        "gpuledger.io/gpu-core",
        "aliyun.com/gpu-mem",
        "nvidia.com/gpumem",
        "nvidia.com/gpumem-percentage",
        "nvidia.com/gpucores",
    ];
    usize::from(gpuish.iter().any(|k| get(k).is_some()))
}

/// Which step of starting a GPU container.
#[derive(Clone, Copy)]
pub(super) enum Step<'a> {
    /// Allocate this many devices at admission (the device manager, one pod at a time).
    Allocate(usize),
    /// PreStartContainer of these devices when the container starts (each pod's own worker).
    PreStart(&'a [String]),
}

/// Allocate devices for one container, or PreStartContainer the devices it got, retried
/// (the agent may be restarting) until the admission timeout.
pub(super) async fn device_step(
    ctx: &NodeCtx,
    (ns, name, uid): (&str, &str, &str),
    container: &str,
    step: Step<'_>,
    stop: &CancellationToken,
) -> Result<Option<Allocated>> {
    let deadline = Instant::now() + ctx.admit_timeout;
    let mut attempt = 0u32;
    let pod_key = format!("{ns}/{name}");
    let at = PodAt {
        pod: &pod_key,
        uid,
        node: &ctx.node,
    };
    loop {
        attempt += 1;
        let e: anyhow::Error = match step {
            Step::Allocate(n) => match ctx.kubelet.allocate(ns, name, container, n).await {
                Ok(a) => {
                    ctx.log(&format!(
                        "{ns}/{name}/{container}: Allocate {:?} in {} ms",
                        a.device_ids,
                        a.elapsed.as_millis()
                    ));
                    let id = a
                        .response
                        .envs
                        .get("GPULEDGER_ALLOCATION_ID")
                        .and_then(|v| v.parse().ok());
                    let devices = a.device_ids.join(",");
                    ctx.runs
                        .history
                        .record("allocate", at, Outcome::Ok, id, devices);
                    return Ok(Some(a));
                }
                Err(e) => {
                    let outcome = allocate_outcome(&e);
                    ctx.runs
                        .history
                        .record("allocate", at, outcome, None, format!("{e:#}"));
                    e.context("Allocate")
                }
            },
            Step::PreStart(ids) => match ctx.kubelet.pre_start(ids).await {
                Ok(()) => return Ok(None),
                Err(e) => e.context("PreStartContainer"),
            },
        };
        if Instant::now() > deadline || stop.is_cancelled() {
            return Err(e.context(format!("gave up after {attempt} attempts")));
        }
        if attempt == 1 || attempt.is_multiple_of(20) {
            ctx.log(&format!(
                "{ns}/{name}/{container}: {e:#} (attempt {attempt}; retrying)"
            ));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// What a failed Allocate tells the kubelet: the agent refused (or was not there to ask),
/// or the call may have reached it and nobody knows what it did.
fn allocate_outcome(e: &anyhow::Error) -> Outcome {
    let status = e.chain().find_map(|c| c.downcast_ref::<tonic::Status>());
    match status.map(tonic::Status::code) {
        Some(tonic::Code::DeadlineExceeded | tonic::Code::Cancelled | tonic::Code::Unknown) => {
            Outcome::Unknown
        }
        Some(tonic::Code::Unavailable) if !format!("{e:#}").contains("connect") => Outcome::Unknown,
        _ => Outcome::Fail,
    }
}
