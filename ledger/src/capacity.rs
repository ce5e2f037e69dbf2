//! DRA consumable capacity: how much of a device's capacity one claim result consumes, given
//! what the request asks and the device's request policy (resource.k8s.io/v1
//! `CapacityRequestPolicy`, as the scheduler's structured allocator applies it in 1.37). The
//! allocator recomputes a result's `consumedCapacity` with it before granting: a claim that
//! declares less than this is refused.
//!
//! Amounts are integers in the capacity's own unit (MiB for `memory`, core_milli for `cores`),
//! so the fractional milli-unit arithmetic of `DRAFractionalCapacityRange` never applies.

/// Which requested amounts a policy accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Valid {
    /// No constraint besides the capacity itself.
    Any,
    /// `validRange`: at least `min` (smaller requests round up to it), at most `max`, and
    /// `min + n * step` when a step is set (off-step requests round up).
    Range {
        /// Smallest amount consumed.
        min: u64,
        /// Largest amount a request may consume.
        max: Option<u64>,
        /// Granularity above `min`; never 0.
        step: Option<u64>,
    },
    /// `validValues`, ascending: a request rounds up to the first value at or above it.
    Values(Vec<u64>),
}

/// A device capacity (`DeviceCapacity`): its value and request policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceCapacity {
    /// The device's total.
    pub value: u64,
    /// `requestPolicy`; `None` lets a request consume any amount, and a request that leaves
    /// the capacity out consume all of it.
    pub policy: Option<RequestPolicy>,
}

/// `CapacityRequestPolicy`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestPolicy {
    /// What a request that leaves this capacity out consumes (`None`: the whole value).
    pub default: Option<u64>,
    /// The accepted amounts.
    pub valid: Valid,
}

/// Why a device cannot serve a request's capacity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CapacityError {
    /// The amount, once rounded, breaks the policy or exceeds the device: the device is not
    /// eligible for this request (another device may be).
    #[error("{amount} does not satisfy the device's capacity policy: {why}")]
    Ineligible {
        /// The amount after rounding.
        amount: u64,
        /// Which rule it breaks.
        why: &'static str,
    },
    /// Rounding up would pass `u64::MAX`, or the policy is malformed (step 0): the request
    /// cannot be served by any rounding.
    #[error("capacity request {0} cannot be rounded under this policy")]
    NotRepresentable(u64),
}

/// The capacities of a gpuledger DRA device (one GPU; docs/dra.md): `memory` in MiB and
/// `cores` in thousandths of the GPU, each defaulting to the whole GPU, `memory` in steps of
/// 1 MiB from 1 MiB, `cores` in steps of 1 from 0. The node agent publishes them in its
/// ResourceSlice; the allocator recomputes a result's share with them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuCapacities {
    /// `memory`, in MiB.
    pub memory: DeviceCapacity,
    /// `cores`, in thousandths of the GPU.
    pub cores: DeviceCapacity,
}

impl GpuCapacities {
    /// The capacities of a GPU of `memory_mib`.
    pub fn of_gpu(memory_mib: u64) -> Self {
        let whole = |value: u64, min: u64| DeviceCapacity {
            value,
            policy: Some(RequestPolicy {
                default: Some(value),
                valid: Valid::Range {
                    min,
                    max: None,
                    step: Some(1),
                },
            }),
        };
        GpuCapacities {
            memory: whole(memory_mib, 1),
            cores: whole(u64::from(crate::CORE_MILLI_PER_GPU), 0),
        }
    }
}

/// What a request consumes of `cap`: `requested` (`None` when the request leaves the capacity
/// out) rounded up by the policy, then checked against the policy and the device's value.
pub fn consumed(requested: Option<u64>, cap: &DeviceCapacity) -> Result<u64, CapacityError> {
    let amount = match (requested, &cap.policy) {
        (
            None,
            Some(RequestPolicy {
                default: Some(d), ..
            }),
        ) => *d,
        (None, _) => cap.value,
        (Some(r), None) => r,
        (Some(r), Some(p)) => round_up(r, &p.valid)?,
    };
    if let Some(p) = &cap.policy {
        violates(amount, p)?;
    }
    if amount > cap.value {
        return Err(CapacityError::Ineligible {
            amount,
            why: "more than the device's capacity",
        });
    }
    Ok(amount)
}

fn round_up(r: u64, valid: &Valid) -> Result<u64, CapacityError> {
    Ok(match valid {
        Valid::Any => r,
        Valid::Range { min, .. } if r < *min => *min,
        Valid::Range { step: None, .. } => r,
        Valid::Range {
            min,
            step: Some(step),
            ..
        } => {
            if *step == 0 {
                return Err(CapacityError::NotRepresentable(r));
            }
            let n = (r - min).div_ceil(*step);
            n.checked_mul(*step)
                .and_then(|x| x.checked_add(*min))
                .ok_or(CapacityError::NotRepresentable(r))?
        }
        // Past every valid value the request stays as asked, and the policy check refuses it.
        Valid::Values(vs) => vs.iter().copied().find(|v| r <= *v).unwrap_or(r),
    })
}

fn violates(amount: u64, p: &RequestPolicy) -> Result<(), CapacityError> {
    // The default is valid by API validation, whatever the range or list says.
    if p.default == Some(amount) {
        return Ok(());
    }
    let why = match &p.valid {
        Valid::Range { max: Some(m), .. } if amount > *m => "above the range's max",
        Valid::Range { min, .. } if amount < *min => "below the range's min",
        Valid::Range {
            min, step: Some(s), ..
        } if *s == 0 || !(amount - min).is_multiple_of(*s) => "not min plus a multiple of step",
        Valid::Values(vs) if !vs.is_empty() && !vs.contains(&amount) => "not one of validValues",
        _ => return Ok(()),
    };
    Err(CapacityError::Ineligible { amount, why })
}

#[cfg(test)]
mod tests;
