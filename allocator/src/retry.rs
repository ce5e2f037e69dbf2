//! How the replica retries what may work a moment later (etcd or the API server back).

use std::time::Duration;

use backon::ConstantBuilder;

/// Retry every `delay`, for as long as it takes (the caller cancels or stops retrying).
pub(crate) fn forever(delay: Duration) -> ConstantBuilder {
    ConstantBuilder::default()
        .with_delay(delay)
        .without_max_times()
}
