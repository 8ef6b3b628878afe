//! A single-node Slurm cluster from Debian's packages, in a temporary directory: `munged` (as
//! the munge user, on its own socket and key), `slurmctld` and `slurmd` with a generated
//! `slurm.conf` (no systemd, no slurmdbd, no cgroups). GPUs are faked with character devices
//! made by `mknod` (slurmd drops gres files that are not devices). Dropping it cancels every
//! job, waits for them to end, and stops the daemons: nothing is left running.
//!
//! Needs root (the daemons, `mknod`, `runuser`) and the packages `slurmctld slurmd
//! slurm-client munge` (deploy/debian-packages.txt, tag `tests`).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// The cluster's one node has this many fake A100s.
pub const GPUS: u32 = 2;

pub struct SlurmCluster {
    pub dir: tempfile::TempDir,
    pub conf: PathBuf,
    /// Where jobs write their output (mode 1777).
    pub output_dir: PathBuf,
    /// The apptainer stand-in's directory, on the jobs' PATH.
    pub bin_dir: PathBuf,
    /// Where the stand-in records each call's arguments, one file per call.
    pub calls_dir: PathBuf,
}

fn must(output: std::io::Result<Output>, what: &str) -> Output {
    let output = output.unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        output.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn require(program: &str) -> PathBuf {
    for dir in ["/usr/sbin", "/usr/bin", "/sbin", "/bin"] {
        let path = Path::new(dir).join(program);
        if path.exists() {
            return path;
        }
    }
    panic!(
        "{program} is not installed: the Slurm tests need Debian's slurmctld slurmd slurm-client \
         munge (deploy/install-packages.sh tests)"
    );
}

/// A free TCP port on the loopback. Slurm binds its ports itself, so the port is probed and
/// released; the window before the daemon binds it is small.
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

impl SlurmCluster {
    pub fn start() -> Self {
        assert_eq!(
            effective_uid(),
            0,
            "the Slurm tests run slurmctld, slurmd and munged: run them as root"
        );
        let munged = require("munged");
        let slurmctld = require("slurmctld");
        let slurmd = require("slurmd");
        require("sbatch");
        let dir = tempfile::Builder::new()
            .prefix("ongrid-slurm-")
            .tempdir()
            .unwrap();
        let root = dir.path().to_owned();
        // munged and the jobs' account must reach their files below it.
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
        let mkdir = |name: &str, mode: u32| {
            let path = root.join(name);
            std::fs::create_dir_all(&path).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            path
        };
        for name in ["state", "spool", "log", "dev"] {
            mkdir(name, 0o755);
        }
        let output_dir = mkdir("out", 0o1777);
        let calls_dir = mkdir("calls", 0o1777);
        let bin_dir = mkdir("bin", 0o755);
        let munge_dir = mkdir("munge", 0o755);
        let key_dir = mkdir("munge/key", 0o700);
        let key: Vec<u8> = (0..1024).map(|_| rand_byte()).collect();
        std::fs::write(key_dir.join("munge.key"), key).unwrap();
        std::fs::set_permissions(
            key_dir.join("munge.key"),
            std::fs::Permissions::from_mode(0o400),
        )
        .unwrap();
        must(
            Command::new("chown")
                .args(["-R", "munge:munge"])
                .arg(&munge_dir)
                .output(),
            "chown munge",
        );
        let socket = munge_dir.join("munge.sock");
        must(
            Command::new("runuser")
                .args(["-u", "munge", "--"])
                .arg(&munged)
                .arg(format!("--socket={}", socket.display()))
                .arg(format!(
                    "--key-file={}",
                    key_dir.join("munge.key").display()
                ))
                .arg(format!(
                    "--pid-file={}",
                    munge_dir.join("munged.pid").display()
                ))
                .arg(format!(
                    "--log-file={}",
                    munge_dir.join("munged.log").display()
                ))
                .arg(format!("--seed-file={}", munge_dir.join("seed").display()))
                .output(),
            "starting munged",
        );
        // Fake GPUs: character devices with NVIDIA's major number.
        for i in 0..GPUS {
            must(
                Command::new("mknod")
                    .arg(root.join(format!("dev/nvidia{i}")))
                    .args(["c", "195", &i.to_string()])
                    .output(),
                "mknod",
            );
        }
        // The apptainer stand-in: records its arguments, then runs the command as apptainer
        // exec would inside the image.
        let stand_in = bin_dir.join("apptainer");
        std::fs::write(
            &stand_in,
            format!(
                "#!/bin/sh\n\
                 # apptainer stand-in for the tests: record the arguments, run the command.\n\
                 f=$(mktemp {calls}/call.XXXXXX)\n\
                 for a in \"$@\"; do printf '%s\\n' \"$a\" >> \"$f\"; done\n\
                 [ \"$1\" = exec ] || exit 99\n\
                 shift\n\
                 while [ \"${{1#-}}\" != \"$1\" ]; do shift; done\n\
                 shift\n\
                 exec \"$@\"\n",
                calls = calls_dir.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&stand_in, std::fs::Permissions::from_mode(0o755)).unwrap();

        let node =
            String::from_utf8(must(Command::new("hostname").arg("-s").output(), "hostname").stdout)
                .unwrap()
                .trim()
                .to_owned();
        let conf = root.join("slurm.conf");
        let r = root.display();
        std::fs::write(
            &conf,
            format!(
                "ClusterName=ongridtest\n\
                 SlurmctldHost={node}(127.0.0.1)\n\
                 SlurmUser=root\n\
                 SlurmdUser=root\n\
                 SlurmctldPort={ctld}\n\
                 SlurmdPort={d}\n\
                 AuthType=auth/munge\n\
                 AuthInfo=socket={socket}\n\
                 StateSaveLocation={r}/state\n\
                 SlurmdSpoolDir={r}/spool\n\
                 SlurmctldPidFile={r}/slurmctld.pid\n\
                 SlurmdPidFile={r}/slurmd.pid\n\
                 SlurmctldLogFile={r}/log/slurmctld.log\n\
                 SlurmdLogFile={r}/log/slurmd.log\n\
                 ProctrackType=proctrack/linuxproc\n\
                 TaskPlugin=task/none\n\
                 JobCompType=jobcomp/filetxt\n\
                 JobCompLoc={r}/jobcomp.txt\n\
                 SchedulerParameters=sched_min_interval=0\n\
                 RequeueExit=85\n\
                 GresTypes=gpu\n\
                 SelectType=select/cons_tres\n\
                 SelectTypeParameters=CR_Core\n\
                 ReturnToService=2\n\
                 MpiDefault=none\n\
                 NodeName={node} NodeAddr=127.0.0.1 CPUs=2 RealMemory=4000 Gres=gpu:a100:{GPUS} State=UNKNOWN\n\
                 PartitionName=gpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n",
                ctld = free_port(),
                d = free_port(),
                socket = socket.display(),
            ),
        )
        .unwrap();
        std::fs::write(
            root.join("gres.conf"),
            format!(
                "NodeName={node} Name=gpu Type=a100 File={r}/dev/nvidia[0-{}]\n",
                GPUS - 1
            ),
        )
        .unwrap();
        must(
            Command::new(&slurmctld)
                .arg("-f")
                .arg(&conf)
                .arg("-c")
                .output(),
            "starting slurmctld",
        );
        must(
            Command::new(&slurmd).arg("-f").arg(&conf).output(),
            "starting slurmd",
        );
        let cluster = Self {
            dir,
            conf,
            output_dir,
            bin_dir,
            calls_dir,
        };
        cluster.wait_idle();
        cluster
    }

    /// A Slurm command with this cluster's `SLURM_CONF`.
    pub fn command(&self, program: &str) -> Command {
        let mut command = Command::new(program);
        command.env("SLURM_CONF", &self.conf);
        command
    }

    pub fn run(&self, program: &str, args: &[&str]) -> String {
        let output = must(
            self.command(program).args(args).output(),
            &format!("{program} {}", args.join(" ")),
        );
        String::from_utf8(output.stdout).unwrap()
    }

    fn wait_idle(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let output = self.command("sinfo").args(["-h", "-o", "%T"]).output();
            if let Ok(output) = output {
                if String::from_utf8_lossy(&output.stdout).trim() == "idle" {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "the Slurm node is not idle within 60 s:\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// One job of `squeue --json` as JSON.
    pub fn squeue_job(&self, id: &str) -> Option<serde_json::Value> {
        let text = self.run("squeue", &["--json"]);
        let all: serde_json::Value = serde_json::from_str(&text).unwrap();
        all["jobs"]
            .as_array()?
            .iter()
            .find(|j| j["job_id"].as_u64().is_some_and(|n| n.to_string() == id))
            .cloned()
    }

    /// Every recorded apptainer call, each as its argument list.
    pub fn apptainer_calls(&self) -> Vec<Vec<String>> {
        let mut calls = Vec::new();
        for entry in std::fs::read_dir(&self.calls_dir).unwrap() {
            let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
            calls.push(text.lines().map(str::to_owned).collect());
        }
        calls
    }

    pub fn logs(&self) -> String {
        let root = self.dir.path();
        let mut text = String::new();
        for name in ["log/slurmctld.log", "log/slurmd.log"] {
            let log = std::fs::read_to_string(root.join(name)).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            text.push_str(&format!("--- {name}\n"));
            for line in tail.into_iter().rev() {
                text.push_str(line);
                text.push('\n');
            }
        }
        text
    }

    fn pid(&self, file: &str) -> Option<i32> {
        std::fs::read_to_string(self.dir.path().join(file))
            .ok()?
            .trim()
            .parse()
            .ok()
    }
}

impl Drop for SlurmCluster {
    fn drop(&mut self) {
        // Every job ends first, so no slurmstepd outlives the daemons.
        let _ = self.command("scancel").args(["--partition=gpu"]).output();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            let busy = self
                .command("squeue")
                .args(["-h", "-t", "RUNNING,COMPLETING,CONFIGURING", "-o", "%i"])
                .output()
                .map(|o| !String::from_utf8_lossy(&o.stdout).trim().is_empty())
                .unwrap_or(false);
            if !busy {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let pids = [
            self.pid("slurmd.pid"),
            self.pid("slurmctld.pid"),
            self.pid("munge/munged.pid"),
        ];
        for pid in pids.into_iter().flatten() {
            stop(pid);
        }
    }
}

/// SIGTERM, then SIGKILL after 10 s; returns once the process is gone.
fn stop(pid: i32) {
    let alive = || Path::new(&format!("/proc/{pid}")).exists() && !zombie(pid);
    let _ = Command::new("kill").arg(pid.to_string()).output();
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    if alive() {
        let _ = Command::new("kill").args(["-9", &pid.to_string()]).output();
    }
}

fn zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.split(") ")
                .nth(1)
                .is_some_and(|rest| rest.starts_with('Z'))
        })
        .unwrap_or(true)
}

fn rand_byte() -> u8 {
    uuid::Uuid::new_v4().as_bytes()[0]
}

/// The effective user id (from /proc, so no libc binding is needed).
fn effective_uid() -> u32 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        .and_then(|id| id.parse().ok())
        .unwrap_or(u32::MAX)
}
