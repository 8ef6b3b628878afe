//! A running container's CPU time read from its cgroup's counter on the host, for activity
//! sampling (`crate::activity`).
//!
//! Docker's stats API answers from its stats collector, which samples every container once a
//! second: on Docker 20.10 even a `one-shot` request for one container waited about a second,
//! and a sync that sampled its containers' CPU use spent that second before reporting and
//! converging, so a session placed meanwhile started that much later. The counter itself is
//! one file: `cpuacct.usage` (nanoseconds) under cgroup v1, the `usage_usec` line of
//! `cpu.stat` under cgroup v2, in the cgroup `/proc/<pid>/cgroup` names for the container's
//! first process. These are the numbers Docker's stats report as `cpu_usage.total_usage`.
//!
//! Read only when a component of the process's cgroup path names the container (Docker's
//! cgroup drivers name it `<id>` and `docker-<id>.scope`: `/docker/<id>`,
//! `/system.slice/docker-<id>.scope`), and from that cgroup, the container's own, even when the
//! process sits in one below it; so a PID reused by another process is never read as the
//! container's. Where the file cannot be read (an agent in a container of its own without the
//! host's `/proc` or cgroup filesystem, another layout) the caller asks Docker instead. The
//! parsing is three colon-separated fields per line and one number per file: not worth a
//! dependency.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// Where the host's process and cgroup filesystems are mounted (tests point them elsewhere).
#[derive(Debug, Clone)]
pub struct CgroupFs {
    proc: PathBuf,
    cgroup: PathBuf,
}

impl CgroupFs {
    /// `/proc` and `/sys/fs/cgroup`.
    pub fn host() -> Self {
        Self::at("/proc", "/sys/fs/cgroup")
    }

    pub fn at(proc: impl Into<PathBuf>, cgroup: impl Into<PathBuf>) -> Self {
        Self {
            proc: proc.into(),
            cgroup: cgroup.into(),
        }
    }

    /// CPU time used so far by the cgroup of process `pid`, when that cgroup is container
    /// `id`'s and its counter can be read here; `None` otherwise.
    pub async fn cpu_time(&self, id: &str, pid: u32) -> Option<Duration> {
        let membership = tokio::fs::read_to_string(self.proc.join(pid.to_string()).join("cgroup"))
            .await
            .ok()?;
        for counter in counters(&self.cgroup, &membership, id) {
            if let Ok(text) = tokio::fs::read_to_string(&counter.path).await {
                return counter.kind.parse(&text);
            }
        }
        None
    }
}

/// Which file holds a CPU counter, and in what form.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Counter {
    path: PathBuf,
    kind: CounterKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CounterKind {
    /// cgroup v1 `cpuacct.usage`: nanoseconds.
    CpuacctUsage,
    /// cgroup v2 `cpu.stat`: the `usage_usec` line, microseconds.
    CpuStat,
}

impl CounterKind {
    fn parse(self, text: &str) -> Option<Duration> {
        match self {
            Self::CpuacctUsage => text.trim().parse().ok().map(Duration::from_nanos),
            Self::CpuStat => text.lines().find_map(|line| {
                let value = line.strip_prefix("usage_usec ")?;
                value.trim().parse().ok().map(Duration::from_micros)
            }),
        }
    }
}

/// The counter files that may hold the CPU time of the cgroups in `membership` (the text of a
/// `/proc/<pid>/cgroup`), most precise first, only for cgroups whose path has a component that
/// names container `id` ([`container_cgroup`]). cgroup v1's `cpuacct` hierarchy is mounted by
/// the names of its controllers (`cpu,cpuacct`, often with `cpuacct` linked to it); v2's
/// unified one at the root, or at `unified` beside v1's on a hybrid host.
fn counters(root: &Path, membership: &str, id: &str) -> Vec<Counter> {
    let mut v1 = Vec::new();
    let mut v2 = Vec::new();
    for line in membership.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(hierarchy), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let Some(relative) = container_cgroup(path, id) else {
            continue;
        };
        if controllers.split(',').any(|c| c == "cpuacct") {
            let mut mounts = vec![controllers];
            for usual in ["cpuacct", "cpu,cpuacct"] {
                if !mounts.contains(&usual) {
                    mounts.push(usual);
                }
            }
            for mount in mounts {
                v1.push(Counter {
                    path: root.join(mount).join(&relative).join("cpuacct.usage"),
                    kind: CounterKind::CpuacctUsage,
                });
            }
        } else if hierarchy == "0" && controllers.is_empty() {
            for mount in ["", "unified"] {
                v2.push(Counter {
                    path: root.join(mount).join(&relative).join("cpu.stat"),
                    kind: CounterKind::CpuStat,
                });
            }
        }
    }
    v1.extend(v2);
    v1
}

/// The container's own cgroup in `path` (relative, without the leading `/`): the path up to
/// the component that names container `id`, as Docker's cgroup drivers name it (`<id>` for
/// cgroupfs, `docker-<id>.scope` for systemd). A process the container started in a cgroup of
/// its own below that one is counted by it. `None` when no component names it, or the path
/// leaves the reader's cgroup namespace (`..`).
fn container_cgroup(path: &str, id: &str) -> Option<PathBuf> {
    if id.is_empty() {
        return None;
    }
    let scope = format!("docker-{id}.scope");
    let mut kept = PathBuf::new();
    for component in path.split('/').filter(|c| !c.is_empty()) {
        if component == ".." {
            return None;
        }
        kept.push(component);
        if component == id || component == scope {
            return Some(kept);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "57993bda11d8747741541f628524cde8dc41a7aedd26a77cdb1bfd2808554eae";

    fn write(path: &Path, text: &str) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    #[test]
    fn the_counters_are_those_of_the_cgroups_that_name_the_container() {
        let root = Path::new("/sys/fs/cgroup");
        // A hybrid host, Docker's cgroupfs driver (as /proc/<pid>/cgroup lists it).
        let hybrid =
            format!("9:name=systemd:/docker/{ID}\n4:cpu,cpuacct:/docker/{ID}\n0::/docker/{ID}\n");
        let paths: Vec<_> = counters(root, &hybrid, ID)
            .into_iter()
            .map(|c| (c.path.display().to_string(), c.kind))
            .collect();
        assert_eq!(
            paths,
            [
                (
                    format!("/sys/fs/cgroup/cpu,cpuacct/docker/{ID}/cpuacct.usage"),
                    CounterKind::CpuacctUsage
                ),
                (
                    format!("/sys/fs/cgroup/cpuacct/docker/{ID}/cpuacct.usage"),
                    CounterKind::CpuacctUsage
                ),
                (
                    format!("/sys/fs/cgroup/docker/{ID}/cpu.stat"),
                    CounterKind::CpuStat
                ),
                (
                    format!("/sys/fs/cgroup/unified/docker/{ID}/cpu.stat"),
                    CounterKind::CpuStat
                ),
            ]
        );
        // cgroup v2 only, the systemd driver.
        let unified = format!("0::/system.slice/docker-{ID}.scope\n");
        assert_eq!(
            counters(root, &unified, ID)[0].path,
            PathBuf::from(format!(
                "/sys/fs/cgroup/system.slice/docker-{ID}.scope/cpu.stat"
            ))
        );
        // A process the container put in a cgroup below its own: the container's is read.
        let nested = format!("0::/system.slice/docker-{ID}.scope/init.scope\n");
        assert_eq!(
            counters(root, &nested, ID)[0].path,
            PathBuf::from(format!(
                "/sys/fs/cgroup/system.slice/docker-{ID}.scope/cpu.stat"
            ))
        );
        // A process in another cgroup (a PID reused after the container stopped), one whose
        // path only contains the id, one outside the reader's cgroup namespace: nothing.
        assert!(counters(root, "0::/user.slice/session-1.scope\n", ID).is_empty());
        assert!(counters(root, &format!("0::/docker/x{ID}\n"), ID).is_empty());
        assert!(counters(root, &format!("0::/../docker/{ID}\n"), ID).is_empty());
        assert!(counters(root, &unified, "").is_empty());
        assert!(counters(root, "garbage\n\n1:2\n", ID).is_empty());
    }

    #[test]
    fn counters_are_read_in_their_units() {
        assert_eq!(
            CounterKind::CpuacctUsage.parse("23166381\n"),
            Some(Duration::from_nanos(23_166_381))
        );
        assert_eq!(
            CounterKind::CpuStat.parse("usage_usec 5123\nuser_usec 4000\nsystem_usec 1123\n"),
            Some(Duration::from_micros(5123))
        );
        assert_eq!(CounterKind::CpuStat.parse("user_usec 4000\n"), None);
        assert_eq!(CounterKind::CpuacctUsage.parse("max\n"), None);
    }

    #[tokio::test]
    async fn a_containers_cpu_time_comes_from_the_first_counter_that_can_be_read() {
        let dir = tempfile::tempdir().unwrap();
        let fs = CgroupFs::at(dir.path().join("proc"), dir.path().join("cgroup"));
        write(
            &dir.path().join("proc/4242/cgroup"),
            &format!("4:cpu,cpuacct:/docker/{ID}\n0::/docker/{ID}\n"),
        );
        // Only the v2 file exists: read from it.
        write(
            &dir.path()
                .join(format!("cgroup/unified/docker/{ID}/cpu.stat")),
            "usage_usec 7000\n",
        );
        assert_eq!(
            fs.cpu_time(ID, 4242).await,
            Some(Duration::from_micros(7000))
        );
        // v1's counter, once there, comes first.
        write(
            &dir.path()
                .join(format!("cgroup/cpu,cpuacct/docker/{ID}/cpuacct.usage")),
            "9000000\n",
        );
        assert_eq!(fs.cpu_time(ID, 4242).await, Some(Duration::from_millis(9)));
        // Another container's id, or a process that is gone: not read here.
        assert_eq!(fs.cpu_time("0123abcd", 4242).await, None);
        assert_eq!(fs.cpu_time(ID, 4243).await, None);
    }
}
