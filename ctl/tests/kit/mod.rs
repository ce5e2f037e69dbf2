//! What the CLI's integration tests share.

use std::process::Command;

/// Run `gpuledger args…` as the operator whose credential flags are `who`: whether it
/// succeeded, and its stdout and stderr together.
pub fn ctl(who: &[String], args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gpuledger"))
        .args(args)
        .args(who)
        .output()
        .expect("gpuledger runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}
