//! GPU processes as the kernel has them: each one NVML lists is pinned by a pidfd when it is
//! sampled, its owner read from /proc while the pin holds, and a kill goes through that pidfd,
//! so a pid that is reused between the sample and the kill can never be hit.

use std::os::fd::OwnedFd;

use rustix::process::{Pid, Signal, pidfd_open, pidfd_send_signal};

use crate::cgroup::{PodCgroup, pod_of};

/// The inode of the kernel's initial pid namespace (`PROC_PID_INIT_INO`), the one whose pids
/// NVML reports.
const INIT_PID_NS_INODE: u64 = 0xEFFF_FFFC;

/// A process identity that survives pid reuse: its pid and its start time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProcKey {
    /// Process id.
    pub pid: u32,
    /// Start time in clock ticks after boot (`/proc/<pid>/stat` field 22).
    pub start: u64,
}

/// Who a process says it belongs to, and who its cgroups say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcOwner {
    /// The pod its cgroups name.
    pub pod: PodCgroup,
    /// `GPULEDGER_ALLOCATION_ID` from its environment (every grant of its container): a
    /// claim, not a proof.
    pub claimed_allocations: Vec<u64>,
}

/// A live process pinned by a pidfd, with what /proc said about it while pinned.
#[derive(Debug)]
pub struct Sampled {
    /// Its identity.
    pub key: ProcKey,
    /// Its owner.
    pub owner: ProcOwner,
    pidfd: OwnedFd,
}

/// Why a process could not be sampled. None of these is retryable for that process: the next
/// enforcement pass samples again.
#[derive(Debug, thiserror::Error)]
pub enum SampleError {
    /// It exited (or is a zombie) before it could be pinned and read.
    #[error("pid {0} has exited")]
    Gone(u32),
    /// Its pid now names another process than the one first seen.
    #[error("pid {0} was reused while it was being sampled")]
    Reused(u32),
    /// The pid does not fit the kernel's pid type.
    #[error("pid {0} is not a valid process id")]
    BadPid(u32),
    /// Opening its pidfd failed for another reason (permissions, an old kernel).
    #[error("pidfd_open({pid}): {source}")]
    Pidfd {
        /// The process.
        pid: u32,
        /// The kernel's answer.
        source: std::io::Error,
    },
}

/// What a kill through a pidfd did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Killed {
    /// SIGKILL was delivered to the sampled process.
    Now,
    /// The sampled process had already exited; nothing was signalled.
    AlreadyGone,
}

/// The start time and state of a process, from the text of its `/proc/<pid>/stat`.
pub fn parse_stat(stat: &str) -> Option<(u64, char)> {
    // The command name is in parentheses and may itself contain ") ": fields follow the last.
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // After the state (field 3) the start time is field 22.
    let start = fields.nth(18)?.parse().ok()?;
    Some((start, state))
}

/// Start time of a running (not zombie) process, or `None` when it is gone.
fn running_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (start, state) = parse_stat(&stat)?;
    (state != 'Z' && state != 'X').then_some(start)
}

/// Pin `pid` with a pidfd and read who it belongs to. The start time is read before the pidfd
/// is opened and again after /proc was read: the same value both times means the pidfd, the
/// cgroup and the environment are all of the one process first seen.
pub fn sample(pid: u32) -> Result<Sampled, SampleError> {
    let raw = i32::try_from(pid)
        .ok()
        .filter(|p| *p > 0)
        .ok_or(SampleError::BadPid(pid))?;
    let start = running_start(pid).ok_or(SampleError::Gone(pid))?;
    let pidfd = match pidfd_open(
        Pid::from_raw(raw).ok_or(SampleError::BadPid(pid))?,
        rustix::process::PidfdFlags::empty(),
    ) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::SRCH) => return Err(SampleError::Gone(pid)),
        Err(e) => {
            return Err(SampleError::Pidfd {
                pid,
                source: e.into(),
            });
        }
    };
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup"));
    // Unreadable (no CAP_SYS_PTRACE): no claim, which only ever weakens the process's case.
    let claimed_allocations = std::fs::read(format!("/proc/{pid}/environ"))
        .map(|e| allocations_from_environ(&e))
        .unwrap_or_default();
    match running_start(pid) {
        Some(s) if s == start => {}
        Some(_) => return Err(SampleError::Reused(pid)),
        None => return Err(SampleError::Gone(pid)),
    }
    let Ok(cgroup) = cgroup else {
        return Err(SampleError::Gone(pid));
    };
    Ok(Sampled {
        key: ProcKey { pid, start },
        owner: ProcOwner {
            pod: pod_of(&cgroup),
            claimed_allocations,
        },
        pidfd,
    })
}

impl Sampled {
    /// SIGKILL the sampled process through its pidfd: never another one that took its pid.
    pub fn kill(&self) -> std::io::Result<Killed> {
        match pidfd_send_signal(&self.pidfd, Signal::KILL) {
            Ok(()) => Ok(Killed::Now),
            Err(rustix::io::Errno::SRCH) => Ok(Killed::AlreadyGone),
            Err(e) => Err(e.into()),
        }
    }
}

/// How many allocation ids of one process's environment count (a container holds one grant
/// per GPU it uses); the rest are ignored.
pub const MAX_CLAIMED_ALLOCATIONS: usize = 64;

/// The allocation ids of `GPULEDGER_ALLOCATION_ID` (comma-separated) in a `/proc/<pid>/environ`
/// blob; none when it is missing or any id is malformed.
pub fn allocations_from_environ(env: &[u8]) -> Vec<u64> {
    let Some(v) = env
        .split(|b| *b == 0)
        .find_map(|kv| kv.strip_prefix(b"GPULEDGER_ALLOCATION_ID="))
    else {
        return Vec::new();
    };
    let Ok(v) = std::str::from_utf8(v) else {
        return Vec::new();
    };
    v.split(',')
        .take(MAX_CLAIMED_ALLOCATIONS)
        .map(str::parse)
        .collect::<Result<_, _>>()
        .unwrap_or_default()
}

/// Whether a `/proc/<pid>/ns/pid` link target (`pid:[<inode>]`) is the initial pid namespace.
pub fn is_init_pid_ns(link: &str) -> bool {
    link.strip_prefix("pid:[")
        .and_then(|r| r.strip_suffix(']'))
        .and_then(|n| n.parse::<u64>().ok())
        == Some(INIT_PID_NS_INODE)
}

/// Why this agent cannot map NVML's pids to processes, if it can see that: NVML reports pids
/// in the initial (host) pid namespace, and a pid read there means another process, or none,
/// in any other namespace. `None` when the agent is in the host's.
pub fn host_pid_namespace_problem() -> Option<String> {
    match std::fs::read_link("/proc/self/ns/pid") {
        Ok(link) if is_init_pid_ns(&link.to_string_lossy()) => None,
        Ok(link) => Some(format!(
            "the agent is not in the host pid namespace (it is in {}): NVML's pids would name other processes here; run the DaemonSet with hostPID: true",
            link.display()
        )),
        Err(e) => Some(format!(
            "cannot read /proc/self/ns/pid ({e}), so the agent cannot tell whether NVML's pids are its own; run the DaemonSet with hostPID: true and /proc mounted"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_start_time_is_read_past_a_command_with_parentheses() {
        let stat = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10 18446744073709551615";
        assert_eq!(parse_stat(stat), Some((987_654, 'S')));
        assert_eq!(parse_stat("4242 (short) Z 1"), None);
        assert_eq!(parse_stat("no parenthesis"), None);
    }

    #[test]
    fn environ_gives_the_claimed_allocations() {
        assert_eq!(
            allocations_from_environ(b"PATH=/bin\0GPULEDGER_ALLOCATION_ID=42\0HOME=/\0"),
            [42]
        );
        assert_eq!(
            allocations_from_environ(b"GPULEDGER_ALLOCATION_ID=3,4\0"),
            [3, 4]
        );
        assert!(allocations_from_environ(b"PATH=/bin\0").is_empty());
        assert!(allocations_from_environ(b"GPULEDGER_ALLOCATION_ID=4x2\0").is_empty());
        assert!(allocations_from_environ(b"GPULEDGER_ALLOCATION_ID=3,\0").is_empty());
    }

    #[test]
    fn only_the_initial_pid_namespace_is_the_host_one() {
        assert!(is_init_pid_ns("pid:[4026531836]"));
        assert!(!is_init_pid_ns("pid:[4026532512]"));
        assert!(!is_init_pid_ns("net:[4026531836]"));
        assert!(!is_init_pid_ns("garbage"));
    }

    #[test]
    fn a_live_child_is_sampled_and_killed_through_its_pidfd() -> anyhow::Result<()> {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .env("GPULEDGER_ALLOCATION_ID", "7")
            .spawn()?;
        // Right after exec the kernel may not have set up the new environment yet.
        let environ = format!("/proc/{}/environ", child.id());
        for _ in 0..100 {
            if !std::fs::read(&environ)?.is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let s = sample(child.id())?;
        assert_eq!(s.key.pid, child.id());
        assert_eq!(s.owner.claimed_allocations, [7]);
        assert_eq!(s.kill()?, Killed::Now);
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(child.wait()?.signal(), Some(9));
        assert_eq!(
            s.kill()?,
            Killed::AlreadyGone,
            "reaped: nothing left to signal"
        );
        Ok(())
    }
}
