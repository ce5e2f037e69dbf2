//! Which pod a process runs in, read from its `/proc/<pid>/cgroup` text: the one attribution
//! a process cannot choose for itself (its environment it can).
//!
//! The kubelet puts each pod in a cgroup named for its UID, under either cgroup driver:
//! cgroupfs `…/kubepods/burstable/pod<uid>/<container>` and systemd
//! `…/kubepods-burstable-pod<uid with _>.slice/cri-containerd-<id>.scope`, in cgroup v1 and v2
//! alike. The path is relative to the *reader's* cgroup namespace: an agent in its own
//! namespace (the default for containers on cgroup v2) reads `/../../kubepods-besteffort-pod…`
//! or, with cgroupfs, `/../../besteffort/pod<uid>/…` with no `kubepods` left in it. So the pod
//! is found by the shape of one path component; the outermost one counts, since the kubelet
//! created it and a process can only make cgroups below its own. That component must also sit
//! where the kubelet puts pods: under a `kubepods` cgroup at the hierarchy's root (or below one
//! cgroup root, `--cgroup-root`) and its QoS level, or reached from a private namespace by `..`
//! straight to the QoS level. A cgroup named like a pod anywhere else (a user's delegated
//! `user@1000.service/pod<uid>`, a `system.slice/pod<uid>`) is no pod, so a process there cannot
//! pass its GPU use off as another pod's and get that pod's processes killed.

/// What a process's cgroups say about its pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodCgroup {
    /// Every hierarchy that names a pod names this one (the pod UID).
    Pod(String),
    /// No hierarchy names a pod: a node daemon, a container outside Kubernetes.
    NoPod,
    /// Hierarchies name different pods; nothing about the process is trusted.
    Conflict(Vec<String>),
}

/// The pod of a process from the text of its `/proc/<pid>/cgroup` (any number of
/// `<id>:<controllers>:<path>` lines, cgroup v1 and v2).
pub fn pod_of(text: &str) -> PodCgroup {
    let mut pods: Vec<String> = Vec::new();
    for line in text.lines() {
        let Some(path) = line.splitn(3, ':').nth(2) else {
            continue;
        };
        let parts: Vec<&str> = path.split('/').collect();
        let Some((at, uid)) = parts
            .iter()
            .enumerate()
            .find_map(|(i, c)| pod_uid_of_component(c).map(|u| (i, u)))
        else {
            continue;
        };
        if kubelet_made(&parts[..at]) && !pods.contains(&uid) {
            pods.push(uid);
        }
    }
    match pods.len() {
        0 => PodCgroup::NoPod,
        1 => PodCgroup::Pod(pods.remove(0)),
        _ => PodCgroup::Conflict(pods),
    }
}

/// The pod UID a kubelet-made cgroup name carries: `pod<uid>` (cgroupfs) or
/// `kubepods[-<qos>]-pod<uid with _>.slice` (systemd).
pub fn pod_uid_of_component(c: &str) -> Option<String> {
    if let Some(uid) = c.strip_prefix("pod") {
        return is_uid(uid).then(|| uid.to_string());
    }
    let slice = c.strip_prefix("kubepods-")?.strip_suffix(".slice")?;
    let (_qos, uid) = slice.rsplit_once("pod")?;
    let uid = uid.replace('_', "-");
    is_uid(&uid).then_some(uid)
}

/// Whether the cgroups above a pod's (`prefix`, the path's components before it) are where the
/// kubelet makes pod cgroups: `[<cgroup root>/]kubepods[/<qos>]` from the hierarchy's root
/// (`kubepods.slice/kubepods-<qos>.slice` with systemd), or `../..[/<qos>]` from a private
/// cgroup namespace rooted in another pod's container.
fn kubelet_made(prefix: &[&str]) -> bool {
    let qos = |c: &str| {
        matches!(c, "burstable" | "besteffort" | "guaranteed")
            || (c.starts_with("kubepods-") && c.ends_with(".slice"))
    };
    let kubepods = |c: &str| c == "kubepods" || c == "kubepods.slice";
    let mut rest = prefix;
    if rest.first() == Some(&"") {
        rest = &rest[1..];
    }
    let relative = rest.first() == Some(&"..");
    while rest.first() == Some(&"..") {
        rest = &rest[1..];
    }
    while rest.last().is_some_and(|c| qos(c)) {
        rest = &rest[..rest.len() - 1];
    }
    match rest {
        [] => relative,
        [k] | [_, k] => kubepods(k),
        _ => false,
    }
}

/// A Kubernetes object UID: a UUID in its 8-4-4-4-12 lowercase hex form.
fn is_uid(s: &str) -> bool {
    let groups: Vec<&str> = s.split('-').collect();
    groups.len() == 5
        && groups.iter().zip([8, 4, 4, 4, 12]).all(|(g, n)| {
            g.len() == n
                && g.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
    const UID_: &str = "0f1e2d3c_4b5a_6978_8796_a5b4c3d2e1f0";

    fn pod() -> PodCgroup {
        PodCgroup::Pod(UID.into())
    }

    #[test]
    fn absolute_paths_of_both_drivers_name_the_pod() {
        let cgroupfs_v2 = format!("0::/kubepods/burstable/pod{UID}/abcdef0123\n");
        let systemd_v2 = format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-1f2e.scope\n"
        );
        let guaranteed = format!("0::/kubepods.slice/kubepods-pod{UID_}.slice/crio-1f2e.scope\n");
        for text in [cgroupfs_v2, systemd_v2, guaranteed] {
            assert_eq!(pod_of(&text), pod(), "{text}");
        }
    }

    #[test]
    fn relative_paths_in_a_private_cgroup_namespace_name_the_pod() {
        // The agent's namespace root is its own container: other pods are reached through `..`,
        // and with cgroupfs not even `kubepods` is left in the path.
        let systemd = format!(
            "0::/../../../kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/cri-containerd-9a.scope\n"
        );
        let cgroupfs = format!("0::/../../../besteffort/pod{UID}/9a8b7c\n");
        assert_eq!(pod_of(&systemd), pod());
        assert_eq!(pod_of(&cgroupfs), pod());
        // The namespace root itself (the agent's own container) says nothing about pods.
        assert_eq!(pod_of("0::/\n"), PodCgroup::NoPod);
    }

    #[test]
    fn cgroup_v1_hierarchies_agree_or_conflict() {
        let v1 = format!(
            "12:pids:/kubepods/besteffort/pod{UID}/c1\n11:memory:/kubepods/besteffort/pod{UID}/c1\n4:cpu,cpuacct:/\n1:name=systemd:/\n0::/\n"
        );
        assert_eq!(pod_of(&v1), pod());
        let other = "11111111-2222-3333-4444-555555555555";
        let split = format!("12:pids:/kubepods/pod{UID}/c\n11:memory:/kubepods/pod{other}/c\n");
        assert_eq!(
            pod_of(&split),
            PodCgroup::Conflict(vec![UID.to_string(), other.to_string()])
        );
    }

    #[test]
    fn the_outermost_pod_wins_over_cgroups_a_container_made_below_itself() {
        let victim = "11111111-2222-3333-4444-555555555555";
        let nested = format!("0::/kubepods/besteffort/pod{UID}/c1/pod{victim}/x\n");
        assert_eq!(pod_of(&nested), pod());
    }

    /// Issue 28: a cgroup anyone with a delegated subtree can make, named like the victim's
    /// pod, must not make its processes count as the victim's.
    #[test]
    fn a_cgroup_named_like_a_pod_outside_kubepods_is_no_pod() {
        for text in [
            format!("0::/user.slice/user-1000.slice/user@1000.service/pod{UID}/x\n"),
            format!("0::/user.slice/user-1000.slice/user@1000.service/kubepods/pod{UID}/x\n"),
            format!("0::/system.slice/kubepods-burstable-pod{UID_}.slice/x.scope\n"),
            format!("0::/pod{UID}\n"),
            format!("0::/../../../../user.slice/user-1000.slice/pod{UID}/x\n"),
            format!("0::/evil/more/kubepods/burstable/pod{UID}/c\n"),
        ] {
            assert_eq!(pod_of(&text), PodCgroup::NoPod, "{text:?}");
        }
        // Below one cgroup root (--cgroup-root, or a test's own tree) is still the kubelet's.
        let rooted = format!("0::/kubelet/kubepods/burstable/pod{UID}/c\n");
        assert_eq!(pod_of(&rooted), pod());
        assert_eq!(pod_of(&format!("0::/kubepods/pod{UID}/c\n")), pod());
    }

    #[test]
    fn paths_without_a_pod_say_nothing() {
        for text in [
            "0::/user.slice/user-1000.slice/session-1.scope\n",
            "0::/system.slice/nvidia-persistenced.service\n",
            "0::/kubepods.slice/kubepods-burstable.slice\n",
            "0::/process_api/612a5aa6c7ab0f8b679c6eaa933aa90c\n",
            "0::/kubepods/burstable/podnot-a-uid/c\n",
            "0::/kubepods/burstable/pod0F1E2D3C-4B5A-6978-8796-A5B4C3D2E1F0/c\n",
            "garbage without colons\n",
            "",
        ] {
            assert_eq!(pod_of(text), PodCgroup::NoPod, "{text:?}");
        }
    }
}
