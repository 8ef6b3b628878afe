//! Bulk SSH throughput through the gateway against OpenSSH's `sshd` and plain `docker exec`, on
//! the same machine in the same run, with the same cipher (chacha20-poly1305).
//!
//! ```text
//! cargo build --release -p ongrid-manager -p ongrid-agent -p devctl -p ongrid-gateway
//! cargo run --release -p ongrid-e2e --example ssh_speed -- [MIB] [ROUNDS]
//! ```
//!
//! Brings up a site of the release binaries (the end-to-end harness) with one session, and a
//! Debian `sshd` (`/usr/sbin/sshd`, package openssh-server) on a loopback port that lets the
//! session's user key in as root. Each round moves MIB MiB (default 1024) each way through
//! each path — down: `head -c N /dev/zero` on the far side into the client's `/dev/null`; up:
//! `head -c N /dev/zero` into `cat > /dev/null` on the far side — and prints MiB/s and the CPU
//! seconds each party spent: the gateway, the agent, dockerd, the container's shim, sshd (with
//! its per-connection processes), the client (ssh or docker) and the whole machine. The paths
//! take turns, so a machine busy with something else slows them alike; on a busy machine the
//! CPU seconds per transfer say more than the rates. Prints the medians and the gateway's ratio to
//! sshd. Needs root (sshd, the agent's iptables rules) and Docker with ongrid/dev:latest.

use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use ongrid_e2e::{docker_lines, SimGpu, Site};

const CIPHER: &str = "chacha20-poly1305@openssh.com";

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let mib: u64 = args
        .next()
        .map_or(1024, |a| a.parse().expect("MIB: a number"));
    let rounds: usize = args
        .next()
        .map_or(3, |a| a.parse().expect("ROUNDS: a number"));
    let bytes = mib << 20;

    let mut site = Site::start(&[SimGpu::a100(1)]);
    let user = site.user("Speed");
    site.allow_loopback();
    site.add_key(&user);
    site.devctl_ok(&user, &["session", "new", "--name", "bulk", "--wait"]);
    let labels = [
        format!("label=ongrid.node={}", site.node),
        "label=ongrid.session.name=bulk".to_owned(),
    ];
    let container = docker_lines(&["ps", "-q", "--filter", &labels[0], "--filter", &labels[1]])
        .pop()
        .expect("the session's container");
    let sshd = Sshd::start(site.dir.path(), &user.ssh_key);
    let sshd_pid = sshd.child.id();
    let site_dir = site.dir.path().display().to_string();
    let full_id = docker_lines(&["inspect", "--format", "{{.Id}}", &container])
        .pop()
        .expect("the container's id");
    let procs = [
        ("gateway", find_pid("ongrid-gateway", &site_dir)),
        ("agent", find_pid("ongrid-agent", &site_dir)),
        ("dockerd", find_pid("dockerd", "")),
        ("shim", find_pid("containerd-shim-runc-v2", &full_id)),
        ("sshd", Some(sshd_pid)),
    ];

    let gateway_ssh = |command: &str| {
        let mut cmd = site.ssh_command(&user, "bulk");
        cmd.args(["-c", CIPHER, command]);
        cmd
    };
    let sshd_ssh = |command: &str| {
        let mut cmd = Command::new("ssh");
        cmd.args(sshd.options(&user.ssh_key));
        cmd.args(["-c", CIPHER, "root@127.0.0.1", command]);
        cmd
    };
    let docker = |command: &str| {
        let mut cmd = Command::new("docker");
        cmd.args(["exec", "-i", &container, "sh", "-c", command]);
        cmd
    };
    let down = format!("head -c {bytes} /dev/zero");
    let up = "cat > /dev/null".to_owned();

    let mut results: Vec<(String, Vec<f64>)> = Vec::new();
    let mut record = |name: &str, rate: f64| match results.iter_mut().find(|(n, _)| n == name) {
        Some((_, rates)) => rates.push(rate),
        None => results.push((name.to_owned(), vec![rate])),
    };
    println!("{mib} MiB each way, {rounds} rounds, cipher {CIPHER}");
    for round in 1..=rounds {
        for (path, make) in [
            ("gateway", &gateway_ssh as &dyn Fn(&str) -> Command),
            ("sshd", &sshd_ssh),
            ("docker exec", &docker),
        ] {
            for (direction, command, input) in [("down", &down, None), ("up", &up, Some(bytes))] {
                let before = cpu_of(&procs);
                let (clients_before, busy_before) = (children_cpu(), busy_cpu());
                let took = transfer(make(command), input, bytes, &format!("{path} {direction}"));
                let after = cpu_of(&procs);
                let rate = mib as f64 / took.as_secs_f64();
                let mut cpu: Vec<String> = procs
                    .iter()
                    .zip(before.iter().zip(&after))
                    .map(|((name, _), (b, a))| format!("{name} {:.2}s", a - b))
                    .collect();
                cpu.push(format!("client {:.2}s", children_cpu() - clients_before));
                cpu.push(format!("machine {:.2}s", busy_cpu() - busy_before));
                println!(
                    "round {round}  {path:>11} {direction:>4}  {rate:7.1} MiB/s  {:6.2} s  cpu: {}",
                    took.as_secs_f64(),
                    cpu.join(", ")
                );
                record(&format!("{path} {direction}"), rate);
            }
        }
    }
    println!();
    let median = |name: &str| {
        let mut rates = results
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, r)| r.clone())
            .unwrap_or_default();
        rates.sort_by(f64::total_cmp);
        rates[rates.len() / 2]
    };
    for direction in ["down", "up"] {
        let (gateway, sshd, docker) = (
            median(&format!("gateway {direction}")),
            median(&format!("sshd {direction}")),
            median(&format!("docker exec {direction}")),
        );
        println!(
            "{direction:>4}: gateway {gateway:.1} MiB/s, sshd {sshd:.1} MiB/s, docker exec {docker:.1} MiB/s; gateway/sshd {:.0}%",
            100.0 * gateway / sshd
        );
    }
    drop(sshd);
    ExitCode::SUCCESS
}

/// Runs `cmd` (feeding `input` bytes of zeros when given) with its stdout into a counter; the
/// wall time, after checking it succeeded and moved `expect` bytes down when it had no input.
fn transfer(mut cmd: Command, input: Option<u64>, expect: u64, what: &str) -> Duration {
    use std::io::{Read, Write};
    cmd.stdin(if input.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let start = Instant::now();
    let mut child = cmd.spawn().expect("spawn the transfer");
    let writer = input.map(|n| {
        let mut stdin = child.stdin.take().expect("stdin");
        std::thread::spawn(move || {
            let block = vec![0u8; 1 << 20];
            let mut left = n;
            while left > 0 {
                let take = left.min(block.len() as u64) as usize;
                stdin.write_all(&block[..take]).expect("write the upload");
                left -= take as u64;
            }
        })
    });
    let mut stdout = child.stdout.take().expect("stdout");
    let mut buffer = vec![0u8; 1 << 20];
    let mut received = 0u64;
    loop {
        let n = stdout.read(&mut buffer).expect("read the download");
        if n == 0 {
            break;
        }
        received += n as u64;
    }
    if let Some(writer) = writer {
        writer.join().expect("the upload writer");
    }
    let out = child.wait_with_output().expect("wait for the transfer");
    let took = start.elapsed();
    assert!(
        out.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    if input.is_none() {
        assert_eq!(received, expect, "{what} moved the wrong number of bytes");
    }
    took
}

/// A process whose command line has `name` and `arg` in it (the first found).
fn find_pid(name: &str, arg: &str) -> Option<u32> {
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        let program = cmdline.split(' ').next().unwrap_or("");
        if program.ends_with(name) && cmdline.contains(arg) {
            return Some(pid);
        }
    }
    None
}

/// User plus system CPU seconds of each process and its waited-for children (0 for one not
/// found).
fn cpu_of(procs: &[(&str, Option<u32>)]) -> Vec<f64> {
    procs
        .iter()
        .map(|(_, pid)| {
            let Some(pid) = pid else { return 0.0 };
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let after_name = stat.rsplit(')').next().unwrap_or("");
            let fields: Vec<&str> = after_name.split_whitespace().collect();
            // utime, stime, cutime and cstime are fields 14 to 17 of stat; 12 to 15 after the
            // name. The waited-for children count: sshd's per-connection processes.
            let ticks: f64 = fields
                .get(11..15)
                .map(|f| f.iter().filter_map(|t| t.parse::<f64>().ok()).sum())
                .unwrap_or(0.0);
            ticks / 100.0
        })
        .collect()
}

/// User plus system CPU seconds of this program's waited-for children (the ssh or docker
/// clients).
fn children_cpu() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after_name = stat.rsplit(')').next().unwrap_or("");
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // cutime and cstime are fields 16 and 17 of stat; 14 and 15 after the name.
    fields
        .get(13..15)
        .map(|f| f.iter().filter_map(|t| t.parse::<f64>().ok()).sum::<f64>())
        .unwrap_or(0.0)
        / 100.0
}

/// CPU seconds the whole machine spent busy (all but idle and iowait), over all cores.
fn busy_cpu() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let line = stat.lines().next().unwrap_or("");
    let ticks: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|t| t.parse().ok())
        .collect();
    let total: f64 = ticks.iter().sum();
    let idle = ticks.get(3).unwrap_or(&0.0) + ticks.get(4).unwrap_or(&0.0);
    (total - idle) / 100.0
}

/// OpenSSH's sshd on a free loopback port, letting `key` in as root; killed when dropped.
struct Sshd {
    child: std::process::Child,
    port: u16,
}

impl Sshd {
    fn start(dir: &Path, key: &Path) -> Self {
        let dir = dir.join("sshd");
        std::fs::create_dir_all(&dir).expect("sshd dir");
        std::fs::create_dir_all("/run/sshd").expect("/run/sshd");
        let host_key = dir.join("host_ed25519");
        let status = Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-f"])
            .arg(&host_key)
            .status()
            .expect("ssh-keygen");
        assert!(status.success());
        let authorized = dir.join("authorized_keys");
        std::fs::copy(format!("{}.pub", key.display()), &authorized).expect("authorized_keys");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let config = dir.join("sshd_config");
        std::fs::write(
            &config,
            format!(
                "Port {port}\nListenAddress 127.0.0.1\nHostKey {}\nAuthorizedKeysFile {}\n\
                 PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n\
                 PasswordAuthentication no\nPidFile none\nMaxStartups 100\n",
                host_key.display(),
                authorized.display()
            ),
        )
        .expect("sshd_config");
        let mut child = Command::new("/usr/sbin/sshd")
            .args(["-D", "-e", "-f"])
            .arg(&config)
            .stderr(Stdio::piped())
            .spawn()
            .expect("run /usr/sbin/sshd (apt-get install openssh-server)");
        // sshd says when it listens; everything it says goes on into sshd.log.
        let stderr = child.stderr.take().expect("sshd stderr");
        let (listening, told) = std::sync::mpsc::channel();
        let mut log = std::fs::File::create(dir.join("sshd.log")).expect("sshd log");
        std::thread::spawn(move || {
            use std::io::{BufRead, Write};
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                if line.starts_with("Server listening on") {
                    let _ = listening.send(());
                }
                let _ = writeln!(log, "{line}");
            }
        });
        told.recv_timeout(Duration::from_secs(10))
            .unwrap_or_else(|_| panic!("sshd did not listen on {port}: see {}", dir.display()));
        Self { child, port }
    }

    fn options(&self, key: &Path) -> Vec<String> {
        ongrid_e2e::ssh_client_options(&self.port.to_string(), key)
    }
}

impl Drop for Sshd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
