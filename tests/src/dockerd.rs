//! A Docker daemon of the test's own, for tests that stop and restart Docker: the machine's
//! daemon, and every container on it, is never touched.
//!
//! [`TestDockerd`] starts `dockerd` with everything of its own, under one temporary directory
//! `/tmp/ongd-XXXXXX/`: its socket (`docker.sock`), `--data-root` (`root/`), `--exec-root`
//! (`exec/`), `--pidfile`, `--config-file` (so `/etc/docker/daemon.json` is not read) and its
//! log (`dockerd.log`). It starts its own containerd (socket and state under `exec/` and
//! `root/`), as dockerd does when given none, so nothing is shared with the machine's
//! containerd, not even a namespace. Its storage driver is the machine daemon's (the one known
//! to work on this file system).
//!
//! **Network.** The daemon runs in a network namespace the test creates, `ongd-<suffix>` (with
//! `nsenter --net`, which changes nothing else: its mounts stay visible to the agent and to
//! runc). Its bridges, routes and iptables rules are in that namespace only, so it can never
//! clash with the machine's `docker0`, its networks' subnets or the host's `DOCKER*` chains,
//! and deleting the namespace removes them all. `--iptables=false` in the host's namespace was
//! the other option; it was not taken because the agent refuses to start containers without
//! Docker's `DOCKER-USER` chain (the sign that dockerd manages iptables), which such a daemon
//! never makes, and because its bridges would still share the host's routing table with the
//! machine daemon's. The daemon makes no default
//! bridge (`"bridge": "none"`), and its default address pool, 10.231.0.0/16, is only used for
//! networks made without a subnet (the agent gives each session network one of its own).
//!
//! The site's agent stays in the host's namespace (it talks to the manager and the gateway over
//! loopback) and reaches this daemon through `DOCKER_HOST`; [`TestDockerd::agent`] says what
//! else it needs: runc's state of this daemon's containers (`[exec] runc_root`) and an iptables
//! that runs in the daemon's namespace (`[network] iptables`, a wrapper script).
//!
//! Dropping a [`TestDockerd`], pass or fail, removes every container it has, stops the daemon,
//! ends whatever of it is left (runc containers, shims, containerd, fuse-overlayfs, mounts under
//! its directory: a daemon with live-restore leaves its containers running when it stops),
//! deletes the namespace and then the directory.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::docker::{docker_lines_on, inspect_container_on, unique_suffix, DEV_IMAGE};

/// How long the daemon may take to answer after its start, or to exit after SIGTERM (it stops
/// its containers first, each with its stop timeout, 10 s).
const DAEMON_BOUND: Duration = Duration::from_secs(90);

/// Docker's default pool for networks made without a subnet; not the machine's 172.17.0.0/16.
const ADDRESS_POOL: &str = "10.231.0.0/16";

/// Docker's `live-restore` for a [`TestDockerd`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LiveRestore {
    /// Containers keep running while the daemon is stopped or restarted.
    On,
    /// The daemon stops every container when it stops (Docker's default).
    Off,
}

/// What a site's agent needs to use a daemon other than the machine's.
#[derive(Debug, Clone)]
pub struct AgentDocker {
    /// `DOCKER_HOST` of the agent: `unix://<socket>`.
    pub host: String,
    /// Tables appended to the agent's config (`[exec]`, `[network]`).
    pub config: String,
}

/// A Docker daemon of the test's own; see the module's documentation.
pub struct TestDockerd {
    dir: tempfile::TempDir,
    netns: String,
    live_restore: LiveRestore,
    storage_driver: String,
    daemon: Option<Child>,
}

impl TestDockerd {
    /// Starts the daemon in a new network namespace, waits until it answers and loads the dev
    /// image into it from the machine's daemon.
    pub fn start(live_restore: LiveRestore) -> Self {
        let storage_driver = machine_storage_driver();
        let dir = tempfile::Builder::new()
            .prefix("ongd-")
            .tempdir_in("/tmp")
            .expect("make the test daemon's directory under /tmp");
        let netns = format!("ongd-{}", unique_suffix());
        let mut dockerd = Self {
            dir,
            netns,
            live_restore,
            storage_driver,
            daemon: None,
        };
        dockerd.make_namespace();
        dockerd.write_files();
        dockerd.spawn();
        dockerd.wait_until_it_answers();
        dockerd.load_dev_image();
        dockerd
    }

    /// `unix://<dir>/docker.sock`, for `DOCKER_HOST` or `docker -H`.
    pub fn host(&self) -> String {
        format!("unix://{}", self.path("docker.sock").display())
    }

    /// What a site's agent needs to use this daemon ([`crate::Site::start_on`]).
    pub fn agent(&self) -> AgentDocker {
        AgentDocker {
            host: self.host(),
            config: format!(
                "\n[exec]\nrunc_root = \"{runc}\"\n\n[network]\niptables = \"{iptables}\"\n",
                runc = self.runc_root().display(),
                iptables = self.path("netns-iptables/iptables").display(),
            ),
        }
    }

    /// A `docker` command against this daemon.
    pub fn docker(&self) -> Command {
        let mut command = Command::new("docker");
        command.arg("-H").arg(self.host());
        command
    }

    /// The non-empty stdout lines of `docker ARGS` against this daemon.
    pub fn docker_lines(&self, args: &[&str]) -> Vec<String> {
        docker_lines_on(Some(&self.host()), args)
    }

    /// `docker inspect` of one container of this daemon, or `None` when it does not exist.
    pub fn inspect_container(&self, name: &str) -> Option<Value> {
        inspect_container_on(Some(&self.host()), name)
    }

    /// Whether the daemon answers `docker version` now.
    pub fn answers(&self) -> bool {
        self.docker()
            .args(["version", "--format", "{{.Server.Version}}"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Stops the daemon with SIGTERM, as `systemctl restart docker` does, waits until it has
    /// exited, starts it again with the same settings and waits until it answers.
    pub fn restart(&mut self) {
        let stopped = self.stop();
        assert!(
            stopped,
            "dockerd did not exit within {DAEMON_BOUND:?} of SIGTERM\n{}",
            self.log_tail()
        );
        self.spawn();
        self.wait_until_it_answers();
    }

    /// The last lines of the daemon's log, for failure messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.path("dockerd.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        format!(
            "--- last lines of the test's dockerd log ---\n{}\n",
            lines[lines.len().saturating_sub(30)..].join("\n")
        )
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// runc's state of this daemon's containers: `<exec-root>/runtime-runc/moby`.
    fn runc_root(&self) -> PathBuf {
        self.path("exec/runtime-runc/moby")
    }

    fn make_namespace(&self) {
        run("ip", &["netns", "add", &self.netns]);
        run("ip", &["-n", &self.netns, "link", "set", "lo", "up"]);
    }

    /// `daemon.json`, and `iptables`/`iptables-restore` wrappers that run in the namespace.
    fn write_files(&self) {
        let config = serde_json::json!({
            "live-restore": self.live_restore == LiveRestore::On,
            "storage-driver": self.storage_driver,
            "bridge": "none",
            "default-address-pools": [{"base": ADDRESS_POOL, "size": 24}],
        });
        std::fs::write(self.path("daemon.json"), config.to_string())
            .expect("write the test daemon's daemon.json");
        let wrappers = self.path("netns-iptables");
        std::fs::create_dir_all(&wrappers).expect("make the iptables wrappers' directory");
        for program in ["iptables", "iptables-restore"] {
            let path = wrappers.join(program);
            std::fs::write(
                &path,
                format!(
                    "#!/bin/sh\nexec nsenter --net=/run/netns/{} /usr/sbin/{program} \"$@\"\n",
                    self.netns
                ),
            )
            .expect("write an iptables wrapper");
            run("chmod", &["755", &path.display().to_string()]);
        }
    }

    /// Starts dockerd in the namespace; its output is appended to `dockerd.log`.
    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.path("dockerd.log"))
            .expect("open the test daemon's log");
        let log_too = log.try_clone().expect("clone the log's handle");
        // nsenter execs dockerd: the child is the daemon itself, and SIGTERM reaches it.
        let child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.netns))
            .arg("--")
            .arg("dockerd")
            .arg("--config-file")
            .arg(self.path("daemon.json"))
            .arg("--host")
            .arg(self.host())
            .arg("--data-root")
            .arg(self.path("root"))
            .arg("--exec-root")
            .arg(self.path("exec"))
            .arg("--pidfile")
            .arg(self.path("docker.pid"))
            .stdin(Stdio::null())
            .stdout(log_too)
            .stderr(log)
            .spawn()
            .expect("start dockerd in its namespace (nsenter, util-linux; dockerd, docker.io)");
        self.daemon = Some(child);
    }

    fn wait_until_it_answers(&mut self) {
        let start = Instant::now();
        while !self.answers() {
            if let Some(status) = self
                .daemon
                .as_mut()
                .and_then(|child| child.try_wait().ok().flatten())
            {
                panic!(
                    "the test's dockerd exited with {status} before answering\n{}",
                    self.log_tail()
                );
            }
            assert!(
                start.elapsed() < DAEMON_BOUND,
                "the test's dockerd did not answer within {DAEMON_BOUND:?}\n{}",
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `docker save` from the machine's daemon into `docker load` of this one.
    fn load_dev_image(&self) {
        let mut save = Command::new("docker")
            .args(["save", DEV_IMAGE])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run docker save");
        let image = save.stdout.take().expect("docker save's stdout");
        let load = self
            .docker()
            .arg("load")
            .stdin(image)
            .output()
            .expect("run docker load");
        let saved = save.wait_with_output().expect("wait for docker save");
        assert!(
            saved.status.success(),
            "docker save {DEV_IMAGE} failed (build it with images/dev/build.sh): {}",
            String::from_utf8_lossy(&saved.stderr)
        );
        assert!(
            load.status.success(),
            "docker load into the test's dockerd failed: {}\n{}",
            String::from_utf8_lossy(&load.stderr),
            self.log_tail()
        );
    }

    /// SIGTERM, then waits up to [`DAEMON_BOUND`] for the daemon to exit, and reaps it; whether
    /// it exited (it is killed otherwise). Never panics: it runs in `Drop`.
    fn stop(&mut self) -> bool {
        let Some(mut child) = self.daemon.take() else {
            return true;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let start = Instant::now();
        while start.elapsed() < DAEMON_BOUND {
            if let Ok(Some(_)) = child.try_wait() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }

    /// Ends the containers runc still runs under this daemon's state directory (a daemon with
    /// live-restore leaves them running when it stops).
    fn kill_runc_containers(&self) {
        let root = self.runc_root().display().to_string();
        let Ok(listing) = Command::new("runc")
            .args(["--root", &root, "list", "--quiet"])
            .stderr(Stdio::null())
            .output()
        else {
            return;
        };
        for id in String::from_utf8_lossy(&listing.stdout).split_whitespace() {
            let _ = Command::new("runc")
                .args(["--root", &root, "delete", "--force", id])
                .stderr(Stdio::null())
                .status();
        }
    }

    /// The mount points under this daemon's directory, deepest first (its data root, which
    /// dockerd bind-mounts onto itself, container file systems, network namespaces).
    fn mounts(&self) -> Vec<String> {
        let prefix = self.dir.path().display().to_string();
        let Ok(file) = std::fs::File::open("/proc/self/mountinfo") else {
            return Vec::new();
        };
        let mut points: Vec<String> = BufReader::new(file)
            .lines()
            .map_while(Result::ok)
            .filter_map(|line| line.split(' ').nth(4).map(str::to_owned))
            .filter(|point| Path::new(point).starts_with(&prefix))
            .collect();
        points.sort_by_key(|point| std::cmp::Reverse(point.len()));
        points
    }

    /// The processes whose command line names this daemon's directory: its containerd, shims
    /// and fuse-overlayfs mounts.
    fn leftover_processes(&self) -> Vec<u32> {
        let needle = self.dir.path().display().to_string();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|entry| {
                let pid = entry.file_name().to_str()?.parse::<u32>().ok()?;
                let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
                String::from_utf8_lossy(&cmdline)
                    .contains(needle.as_str())
                    .then_some(pid)
            })
            .filter(|pid| *pid != std::process::id())
            .collect()
    }
}

impl Drop for TestDockerd {
    fn drop(&mut self) {
        if self.daemon.is_some() && self.answers() {
            let containers = self.docker_lines(&["ps", "-aq"]);
            if !containers.is_empty() {
                let _ = self
                    .docker()
                    .args(["rm", "-f", "-v"])
                    .args(&containers)
                    .output();
            }
        }
        if !self.stop() {
            eprintln!("The test's dockerd did not exit on SIGTERM; killed it.");
        }
        self.kill_runc_containers();
        for point in self.mounts() {
            let _ = Command::new("umount")
                .args(["--lazy", &point])
                .stderr(Stdio::null())
                .status();
        }
        for pid in self.leftover_processes() {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .stderr(Stdio::null())
                .status();
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.netns])
            .stderr(Stdio::null())
            .status();
        // The TempDir removes the directory.
    }
}

/// The storage driver of the machine's daemon, which works on this machine's file system.
fn machine_storage_driver() -> String {
    let out = Command::new("docker")
        .args(["info", "--format", "{{.Driver}}"])
        .output()
        .expect("run docker info (the docker CLI)");
    assert!(
        out.status.success(),
        "the machine's Docker daemon must answer (the test's daemon takes its storage driver and \
         the dev image from it): {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Runs a program that must succeed (the test daemon's set-up needs root).
fn run(program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {program} {}: {e}", args.join(" ")));
    assert!(
        out.status.success(),
        "{program} {} failed (the test's own dockerd needs root and iproute2): {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
}
