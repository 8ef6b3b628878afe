//! One restart of the Docker daemon under a running session.
//!
//! The daemon of the test machine is `dockerd` started by its init (no systemd): the test reads
//! its command line, environment and log file from `/proc`, stops it with SIGTERM, waits until it
//! is gone, and starts it again with the same command line, detached (`setsid --fork`, output
//! appended to the log file it had, else to `/var/log/ongrid-faults-dockerd.log`). [`DaemonRestart`]'s `Drop` starts it again whenever
//! `docker info` fails, so a failing test never leaves the machine without Docker. It takes
//! [`crate::DOCKER`] for writing, so no other test of this binary runs meanwhile; the Docker
//! tests of other binaries and people must not run at the same time either (their containers
//! stop with the daemon).
//!
//! Without live-restore the daemon stops every container when it stops, and ongrid never
//! restarts a container behind the user's back (ARCHITECTURE.md, "Session states and
//! containers"): the session whose container died is FAILED with the exit code within 60 s of
//! the daemon being back, its container is kept for inspection (one, not recreated), and the
//! agent, which kept syncing, starts new sessions again.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ongrid_e2e::{SimGpu, Site};

use crate::{converges_to, one_container, running, show, DOCKER};

/// How long the daemon may take to stop or to answer again.
const DAEMON: Duration = Duration::from_secs(90);

/// Where dockerd's output goes when it had no log file of its own.
const LOG: &str = "/var/log/ongrid-faults-dockerd.log";

fn docker_answers() -> bool {
    Command::new("docker")
        .args(["info", "--format", "{{.ServerVersion}}"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn alive(pid: u32) -> bool {
    // A zombie has no command line left; one that is gone has no directory.
    std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| !c.is_empty())
}

/// Waits up to `bound` for `done`, polling every 200 ms; returns whether it happened.
fn within(bound: Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < bound {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    done()
}

/// The running dockerd: its pid, argv and environment, read from /proc.
#[derive(Debug, Clone)]
struct Dockerd {
    pid: u32,
    argv: Vec<String>,
    env: Vec<(String, String)>,
    /// The regular file its stdout went to (its init's log), if any.
    log: PathBuf,
}

impl Dockerd {
    fn find() -> Self {
        let mut found = Vec::new();
        for entry in std::fs::read_dir("/proc").expect("read /proc").flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
                continue;
            };
            let argv: Vec<String> = cmdline
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            let is_dockerd = argv
                .first()
                .and_then(|a| PathBuf::from(a).file_name().map(|n| n == "dockerd"))
                .unwrap_or(false);
            if is_dockerd {
                found.push((pid, argv));
            }
        }
        assert_eq!(
            found.len(),
            1,
            "the Docker restart test needs exactly one dockerd: {found:?}"
        );
        let (pid, argv) = found.remove(0);
        let environ =
            std::fs::read(format!("/proc/{pid}/environ")).expect("read dockerd's environ");
        let env = environ
            .split(|b| *b == 0)
            .filter_map(|kv| {
                let kv = String::from_utf8_lossy(kv);
                kv.split_once('=')
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
            })
            .collect();
        let log = std::fs::read_link(format!("/proc/{pid}/fd/1"))
            .ok()
            .filter(|path| path.is_file())
            .unwrap_or_else(|| PathBuf::from(LOG));
        Self {
            pid,
            argv,
            env,
            log,
        }
    }

    /// Starts dockerd detached with the recorded command line and environment; whether setsid
    /// could start it (never panics: it runs in `Drop`).
    fn spawn(&self) -> bool {
        let Ok(log) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
        else {
            return false;
        };
        let Ok(log_too) = log.try_clone() else {
            return false;
        };
        // `setsid --fork`: dockerd runs in its own session, reparented to init once setsid
        // exits, as the original was.
        let status = Command::new("setsid")
            .arg("--fork")
            .arg(&self.argv[0])
            .args(&self.argv[1..])
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(log_too)
            .stderr(log)
            .status();
        status.is_ok_and(|s| s.success())
    }
}

/// A restart of dockerd in progress; dropping it makes sure Docker answers again.
struct DaemonRestart {
    daemon: Dockerd,
}

impl DaemonRestart {
    /// Stops dockerd with SIGTERM, waits until it is gone, starts it again and waits until
    /// `docker info` answers.
    fn run() -> Self {
        let daemon = Dockerd::find();
        let guard = Self {
            daemon: daemon.clone(),
        };
        let status = Command::new("kill")
            .args(["-TERM", &daemon.pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM {}", daemon.pid);
        assert!(
            within(DAEMON, || !alive(daemon.pid)),
            "dockerd {} did not stop within {DAEMON:?}",
            daemon.pid
        );
        assert!(daemon.spawn(), "setsid --fork {:?} failed", daemon.argv);
        assert!(
            within(DAEMON, docker_answers),
            "dockerd did not answer within {DAEMON:?} of its start; see {}",
            daemon.log.display()
        );
        guard
    }
}

impl Drop for DaemonRestart {
    fn drop(&mut self) {
        if docker_answers() {
            return;
        }
        // The old daemon may still be stopping; a second one must not start beside it.
        within(DAEMON, || !alive(self.daemon.pid));
        if !within(Duration::from_secs(5), docker_answers) {
            eprintln!(
                "Docker does not answer: starting dockerd again ({}).",
                self.daemon.log.display()
            );
            if !self.daemon.spawn() || !within(DAEMON, docker_answers) {
                eprintln!(
                    "dockerd still does not answer: see {}",
                    self.daemon.log.display()
                );
            }
        }
    }
}

/// Docker restarted once under a WAITING session: its container died with the daemon, so the
/// session is FAILED with the exit code within 60 s, one container kept; a new session is
/// WAITING within 60 s.
#[test]
fn docker_daemon_restart_fails_the_session_whose_container_died_within_60s() {
    let _alone = DOCKER.write().unwrap_or_else(|p| p.into_inner());
    let mut site = Site::start(&[SimGpu::a100(1), SimGpu::a100(2)]);
    let alice = site.user("Alice");
    site.devctl_ok(&alice, &["session", "new", "--name", "train1", "--wait"]);
    let before = show(&site, &alice, "train1");
    let container = one_container(&site, &before);

    let restart = DaemonRestart::run();

    let failed = converges_to(&site, &alice, "train1", "FAILED", Duration::from_secs(60));
    let reason = failed["reason"].as_str().unwrap_or_default();
    assert!(
        reason.starts_with("container exited with code "),
        "{reason}\n{failed:#}"
    );
    assert_eq!(
        one_container(&site, &failed),
        container,
        "kept, not recreated"
    );
    assert!(!running(&failed), "never restarted behind the user's back");

    site.devctl_ok(&alice, &["session", "new", "--name", "after"]);
    let after = converges_to(&site, &alice, "after", "WAITING", Duration::from_secs(60));
    assert!(running(&after));
    one_container(&site, &after);
    drop(restart);
}
