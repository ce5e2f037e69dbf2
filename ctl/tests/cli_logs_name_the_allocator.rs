//! The CLI's diagnostics: silent on stderr but for the error by default, and with
//! GPULEDGER_LOG=debug each replica it tries, named by its address in the span.

use std::process::Command;

use gpuledger_auth::identity::Role;
use gpuledger_testkit::{Identities, Pki};

fn ctl(log: Option<&str>, args: &[&str], who: &[String]) -> (bool, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpuledger"));
    cmd.args(args).args(who).env_remove("GPULEDGER_LOG");
    if let Some(l) = log {
        cmd.env("GPULEDGER_LOG", l);
    }
    let out = cmd.output().expect("gpuledger runs");
    assert!(
        out.stdout.is_empty(),
        "nothing on stdout when no replica answers"
    );
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn each_replica_tried_is_named_in_its_span_and_only_at_debug() -> anyhow::Result<()> {
    // An operator's credentials, so that the CLI goes on to try the replicas.
    let dir = tempfile::tempdir()?;
    let who = Identities::certs(Pki::new(dir.path())?).flags(&Role::Viewer)?;
    // Port 1 on loopback: nothing listens, the connection is refused at once.
    let target = "--allocator=127.0.0.1:1,127.0.0.1:2";
    let (ok, quiet) = ctl(None, &["inspect", target], &who);
    assert!(!ok);
    assert_eq!(quiet.lines().count(), 1, "only the error line:\n{quiet}");
    assert!(
        quiet.starts_with("gpuledger: no allocator replica answered"),
        "{quiet}"
    );

    let (ok, debug) = ctl(Some("gpuledger=debug"), &["inspect", target], &who);
    assert!(!ok);
    for addr in ["127.0.0.1:1", "127.0.0.1:2"] {
        assert!(
            debug.lines().any(|l| l
                .contains(&format!("allocator{{rpc=\"Status\" replica={addr}}}"))
                && l.contains("no answer")),
            "no span names {addr}:\n{debug}"
        );
    }
    assert!(
        !debug.contains('\u{1b}'),
        "no colour codes off a terminal:\n{debug}"
    );
    Ok(())
}
