//! The rules of resource.k8s.io/v1 `CapacityRequestPolicy` (k8s.io/api v0.37.2
//! `resource/v1/types.go`, `CapacityRequestPolicy` and `CapacityRequestPolicyRange`), one row
//! per sentence of the API's documentation.

use super::*;

fn range(min: u64, max: Option<u64>, step: Option<u64>, default: u64) -> DeviceCapacity {
    DeviceCapacity {
        value: 81_079,
        policy: Some(RequestPolicy {
            default: Some(default),
            valid: Valid::Range { min, max, step },
        }),
    }
}

fn values(vs: &[u64], default: u64) -> DeviceCapacity {
    DeviceCapacity {
        value: 1000,
        policy: Some(RequestPolicy {
            default: Some(default),
            valid: Valid::Values(vs.to_vec()),
        }),
    }
}

fn bare(value: u64) -> DeviceCapacity {
    DeviceCapacity {
        value,
        policy: None,
    }
}

fn ineligible(r: Result<u64, CapacityError>) -> bool {
    matches!(r, Err(CapacityError::Ineligible { .. }))
}

#[test]
fn consumed_capacity_follows_the_request_policy() {
    let gpu_memory = range(1, None, Some(1), 81_079);
    /// What, the request, the device, and what it consumes (`Err`: the device is ineligible).
    type Case<'a> = (&'a str, Option<u64>, &'a DeviceCapacity, Result<u64, ()>);
    let cases: &[Case<'_>] = &[
        // "If the request doesn't contain this capacity entry, Default value is used."
        ("left out: the default", None, &gpu_memory, Ok(81_079)),
        (
            "left out, no policy: the whole value",
            None,
            &bare(1000),
            Ok(1000),
        ),
        (
            "left out, policy without default: the whole value",
            None,
            &DeviceCapacity {
                value: 1000,
                policy: Some(RequestPolicy {
                    default: None,
                    valid: Valid::Any,
                }),
            },
            Ok(1000),
        ),
        // "If unset, capacity requests are unconstrained" (up to the capacity).
        ("no policy: as asked", Some(300), &bare(1000), Ok(300)),
        (
            "no policy: more than the device",
            Some(1001),
            &bare(1000),
            Err(()),
        ),
        ("1 MiB steps: as asked", Some(3000), &gpu_memory, Ok(3000)),
        // "If the requested amount is less than Min, it is rounded up to the Min value."
        (
            "below min: min",
            Some(100),
            &range(1024, None, Some(512), 1024),
            Ok(1024),
        ),
        // "... not aligned with Step, it will be rounded up to ... Min + (n * Step)."
        (
            "off step: next step",
            Some(1025),
            &range(1024, None, Some(512), 1024),
            Ok(1536),
        ),
        (
            "on step: as asked",
            Some(2048),
            &range(1024, None, Some(512), 1024),
            Ok(2048),
        ),
        // "If Step is not set, the requested amount is used as-is" within the range.
        (
            "no step: as asked",
            Some(1500),
            &range(1024, Some(4096), None, 1024),
            Ok(1500),
        ),
        // "If the requested or rounded amount exceeds Max ... the device cannot be allocated."
        (
            "above max",
            Some(5000),
            &range(1024, Some(4096), None, 1024),
            Err(()),
        ),
        (
            "rounded above max",
            Some(4050),
            &range(1024, Some(4096), Some(1000), 1024),
            Err(()),
        ),
        ("above the value", Some(90_000), &gpu_memory, Err(())),
        // validValues: "the smallest valid value that is greater than or equal to the request".
        (
            "values: rounded up",
            Some(260),
            &values(&[250, 500, 1000], 1000),
            Ok(500),
        ),
        (
            "values: exact",
            Some(250),
            &values(&[250, 500, 1000], 1000),
            Ok(250),
        ),
        // "If the requested amount exceeds all valid values, ... cannot be allocated."
        (
            "values: above all",
            Some(1001),
            &values(&[250, 500, 1000], 1000),
            Err(()),
        ),
        (
            "cores 0..1000 step 1: zero",
            Some(0),
            &range(0, None, Some(1), 1000),
            Ok(0),
        ),
        (
            "cores: whole GPU",
            None,
            &range(0, None, Some(1), 1000),
            Ok(1000),
        ),
    ];
    for (what, req, cap, want) in cases {
        let got = consumed(*req, cap);
        match want {
            Ok(v) => assert_eq!(got, Ok(*v), "{what}"),
            Err(()) => assert!(ineligible(got.clone()), "{what}: {got:?}"),
        }
    }
}

#[test]
fn rounding_past_u64_or_a_zero_step_is_not_representable() {
    let huge = DeviceCapacity {
        value: u64::MAX,
        policy: Some(RequestPolicy {
            default: None,
            valid: Valid::Range {
                min: 1,
                max: None,
                step: Some(u64::MAX / 2 + 1),
            },
        }),
    };
    assert_eq!(
        consumed(Some(u64::MAX - 1), &huge),
        Err(CapacityError::NotRepresentable(u64::MAX - 1))
    );
    let zero = range(0, None, Some(0), 1);
    assert_eq!(
        consumed(Some(5), &zero),
        Err(CapacityError::NotRepresentable(5))
    );
}

#[test]
fn a_gpu_defaults_to_the_whole_device_and_rounds_to_whole_units() {
    let g = GpuCapacities::of_gpu(16_000);
    assert_eq!(consumed(None, &g.memory), Ok(16_000));
    assert_eq!(consumed(None, &g.cores), Ok(1000));
    assert_eq!(consumed(Some(0), &g.memory), Ok(1));
    assert_eq!(consumed(Some(0), &g.cores), Ok(0));
    assert_eq!(consumed(Some(3000), &g.memory), Ok(3000));
    assert!(consumed(Some(16_001), &g.memory).is_err());
    assert!(consumed(Some(1001), &g.cores).is_err());
}
