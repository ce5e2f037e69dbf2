//! Every integration test of this crate, in one test binary: each file beside this one is a
//! module (`autotests = false` in Cargo.toml), as in the other crates.

mod every_bench_runs;
mod limits_table_names_its_tests;
