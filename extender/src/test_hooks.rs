//! Fault points for tests, compiled in only with the `test-hooks` feature (on for this crate's
//! own tests through its dev-dependency on itself, off in release and production builds).

/// Where a test asks the process to die (a stand-in for a crash at the worst moment).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CrashAt {
    /// After the reservation, before the Binding is created.
    BeforeBinding,
    /// After the Binding is created, before the allocator is told.
    AfterBinding,
}

/// Exit at once, as if killed, when `armed` names `here`.
pub fn crash_if(armed: Option<CrashAt>, here: CrashAt) {
    if armed == Some(here) {
        std::process::exit(99);
    }
}
