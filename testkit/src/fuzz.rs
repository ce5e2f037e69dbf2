//! The fuzzing tier's driver: run a parser of outside input on a fixed number of random and
//! mutated inputs (so `cargo test` and `make test` bound its time), fail on the first panic with
//! the input that caused it, and print how many inputs were tried.

use std::cell::Cell;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// Inputs each parser is given by [`run`].
pub const CASES: u32 = 2000;

/// Run `check` on [`CASES`] inputs of `strategy`; a panic fails the test (proptest shrinks
/// the input and reports it). Prints `fuzz <name>: <n> inputs, 0 panics`.
pub fn run<S: Strategy>(name: &str, strategy: S, check: impl Fn(S::Value)) {
    let mut runner = TestRunner::new(Config {
        cases: CASES,
        failure_persistence: None,
        ..Config::default()
    });
    let tried = Cell::new(0u32);
    let outcome = runner.run(&strategy, |v| {
        tried.set(tried.get() + 1);
        check(v);
        Ok(())
    });
    if let Err(e) = outcome {
        panic!("fuzz {name}: {e}");
    }
    println!("fuzz {name}: {} inputs, 0 panics", tried.get());
    assert_eq!(tried.get(), CASES, "fuzz {name}: not every case ran");
}

/// `sample` with a few bytes replaced, inserted or removed.
pub fn mutated(sample: Vec<u8>) -> impl Strategy<Value = Vec<u8>> {
    let len = sample.len().max(1);
    prop::collection::vec((0..len, any::<u8>(), 0u8..3), 1..8).prop_map(move |edits| {
        let mut b = sample.clone();
        for (at, byte, kind) in edits {
            let at = at.min(b.len());
            match kind {
                0 if at < b.len() => b[at] = byte,
                1 => b.insert(at, byte),
                _ if at < b.len() => {
                    b.remove(at);
                }
                _ => b.push(byte),
            }
        }
        b
    })
}

/// Random bytes, or a mutation of one of `samples` (real inputs: a captured request, a file).
pub fn bytes_like(samples: Vec<Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    let mutations = proptest::sample::select(samples).prop_flat_map(mutated);
    prop_oneof![
        1 => prop::collection::vec(any::<u8>(), 0..512),
        3 => mutations,
    ]
}
