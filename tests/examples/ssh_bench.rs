//! SSH through the gateway against OpenSSH's sshd on the same machine, in the same run: bulk
//! throughput each way, login time one at a time and many at once, and the gateway's and the
//! agent's memory with many idle connections. Run by `bench/run.sh`, which starts the sshd
//! (Debian's `openssh-server`, on a loopback port with its own config, host key and test user)
//! and passes it in the environment:
//!
//! ```text
//! ONGRID_BENCH_SSHD_PORT=P ONGRID_BENCH_SSHD_USER=U ONGRID_BENCH_SSHD_KEY=K ONGRID_BENCH_WORK=D \
//!     ssh_bench [--mib 1024] [--runs 5] [--logins 20] [--concurrent 50] [--active 200] [--idle 1000]
//! ```
//!
//! The site (manager, an agent with a simulated GPU, the gateway) is the end-to-end harness's;
//! one session `bench` of one user serves every gateway measurement. Both sides are driven by
//! the same OpenSSH client with the same cipher ([`CIPHER`]):
//!
//! - throughput: `--mib` MiB of random bytes, [`CHUNK_MIB`] MiB of them repeated (a file in
//!   `ONGRID_BENCH_WORK`, readable by the sshd's user, and the same in the session container's
//!   `/dev/shm`; nothing of the transfer touches a disk, whose write-back on a loaded machine
//!   stalls the site's SQLite long enough for its 10 s node timeout), up with
//!   `ssh T 'cat > /dev/null'` fed by this process and down with `ssh T 'for i in $(seq N); do
//!   cat FILE; done'`, the bytes counted; gateway and sshd alternate, `--runs` times each. The
//!   ratio is the median of each run's ratio (the gateway's rate over sshd's in the same run,
//!   seconds apart): sshd's rate moves by a third from run to run on a 2-core machine, so the
//!   best of each side would compare sshd's luckiest run with the gateway's. The medians of each
//!   side's rates are printed beside it. The times include the login (about 2% of a 1 GiB
//!   transfer).
//! - login: `ssh T true` `--logins` times one after the other (alternating; p50 and p99), then
//!   `--concurrent` at once (the wall time until the last one ended; all must succeed).
//! - idle connections (gateway only): `--idle` connections from one process (russh's client),
//!   each authenticated with the user's key and with a session channel open, no command; the
//!   resident memory of the gateway and the agent before, with all open, and after they closed;
//!   `--idle-rounds` times (default 2) in the one gateway, which tells memory leaked (it grows
//!   again each round) from memory the allocator keeps for reuse (it does not). `--idle-only`
//!   runs only this, without an sshd.
//! - active connections: `--active` connections open at once, logged in first, then each told
//!   to send 4 MiB of the file together (every byte counted; all must succeed), against each
//!   server in turn: the wall time from the go until the last ended, and the highest resident
//!   memory of the gateway and the agent meanwhile (sampled every 50 ms). All of the gateway's
//!   go to the one session, so its container runs them all.
//!
//! Every figure is printed; none is asserted, except that each transfer moved every byte and
//! each login succeeded. The headline rows also go to `ONGRID_BENCH_SUMMARY` when it is set
//! ([`bench_summary`]), for `bench/run.sh`'s table.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ongrid_e2e::{bench_summary, docker_lines, rss_kib, SimGpu, Site, User};

/// The cipher both servers are asked for: OpenSSH's default, and the one the gateway's russh
/// prefers.
const CIPHER: &str = "chacha20-poly1305@openssh.com";
/// The session every gateway measurement uses.
const SESSION: &str = "bench";
/// Where the random file is copied in the session's container (a tmpfs of 64 MiB).
const CONTAINER_BLOB: &str = "/dev/shm/ongrid-bench-blob";
/// The size of the random file: every transfer repeats it.
const CHUNK_MIB: u64 = 32;
/// What each active connection moves, MiB (of the random file, which is larger).
const ACTIVE_MIB: u64 = 4;
/// Active connections logging in at once (the gateway admits 50 not logged in yet per address).
const ACTIVE_LOGINS: usize = 25;
/// Idle connections being set up at once (the gateway admits 50 not logged in yet per address).
const IDLE_IN_FLIGHT: usize = 32;

struct Options {
    mib: u64,
    runs: usize,
    logins: usize,
    concurrent: usize,
    active: usize,
    idle: usize,
    /// How many times the idle connections are opened and closed in the one gateway.
    idle_rounds: usize,
    /// Only the idle connections: no sshd needed.
    idle_only: bool,
}

fn usage() -> String {
    "usage: ssh_bench [--mib N] [--runs N] [--logins N] [--concurrent N] [--active N] [--idle N]\n\
     [--idle-rounds N] [--idle-only]\n\
     (defaults: 1024 MiB, 5 runs, 20 logins, 50 at once, 200 active, 1000 idle connections\n\
     opened and closed 2 times), with\n\
     ONGRID_BENCH_SSHD_PORT, ONGRID_BENCH_SSHD_USER, ONGRID_BENCH_SSHD_KEY and ONGRID_BENCH_WORK\n\
     set (bench/run.sh sets them)"
        .to_owned()
}

fn parse_options() -> Result<Options, String> {
    let mut options = Options {
        mib: 1024,
        runs: 5,
        logins: 20,
        concurrent: 50,
        active: 200,
        idle: 1000,
        idle_rounds: 2,
        idle_only: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--idle-only" {
            options.idle_only = true;
            continue;
        }
        let value = args
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n{}", usage()))?;
        let number: u64 = value
            .parse()
            .map_err(|_| format!("{flag} {value:?} is not a whole number\n{}", usage()))?;
        let count = usize::try_from(number).map_err(|_| format!("{flag} {value} is too large"))?;
        match flag.as_str() {
            "--mib" if number > 0 => options.mib = number,
            "--runs" if number > 0 => options.runs = count,
            "--logins" if number > 0 => options.logins = count,
            "--concurrent" if number > 0 => options.concurrent = count,
            "--active" => options.active = count,
            "--idle" => options.idle = count,
            "--idle-rounds" if number > 0 => options.idle_rounds = count,
            _ => {
                return Err(format!(
                    "unknown or zero option {flag} {value}\n{}",
                    usage()
                ))
            }
        }
    }
    Ok(options)
}

/// The sshd `bench/run.sh` started.
struct Sshd {
    port: String,
    user: String,
    key: PathBuf,
    /// A directory the sshd's user can read: where the random file goes.
    work: PathBuf,
}

impl Sshd {
    fn from_env() -> Result<Self, String> {
        let var =
            |name: &str| std::env::var(name).map_err(|_| format!("{name} is not set\n{}", usage()));
        Ok(Self {
            port: var("ONGRID_BENCH_SSHD_PORT")?,
            user: var("ONGRID_BENCH_SSHD_USER")?,
            key: var("ONGRID_BENCH_SSHD_KEY")?.into(),
            work: var("ONGRID_BENCH_WORK")?.into(),
        })
    }
}

/// One of the two servers, as the OpenSSH client reaches it.
struct Target {
    name: &'static str,
    /// Everything before the remote command: options, cipher, destination.
    args: Vec<String>,
    /// Where the random file is, as seen by the remote command.
    blob: String,
}

impl Target {
    fn gateway(site: &Site, user: &User) -> Self {
        let mut args = site.ssh_options(user);
        args.extend(["-c".to_owned(), CIPHER.to_owned()]);
        args.push(format!("{SESSION}@127.0.0.1"));
        Self {
            name: "gateway",
            args,
            blob: CONTAINER_BLOB.to_owned(),
        }
    }

    fn sshd(sshd: &Sshd, blob: &Path) -> Self {
        let mut args = ongrid_e2e::ssh_client_options(&sshd.port, &sshd.key);
        args.extend(["-c".to_owned(), CIPHER.to_owned()]);
        args.push(format!("{}@127.0.0.1", sshd.user));
        Self {
            name: "sshd",
            args,
            blob: blob.display().to_string(),
        }
    }

    fn command(&self, remote: &str) -> Command {
        let mut command = Command::new("ssh");
        command.args(&self.args).arg(remote);
        command
    }
}

fn main() -> ExitCode {
    let options = match parse_options() {
        Ok(options) => options,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    if options.idle_only {
        let (site, user) = bench_site();
        println!(
            "==> {} idle connections to the gateway, opened and closed {} times",
            options.idle, options.idle_rounds
        );
        idle_connections(&site, &user, options.idle, options.idle_rounds);
        return ExitCode::SUCCESS;
    }
    let sshd = match Sshd::from_env() {
        Ok(sshd) => sshd,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    let (site, user) = bench_site();

    let blob = sshd.work.join("blob");
    let repeats = options.mib.div_ceil(CHUNK_MIB);
    let bytes = repeats * CHUNK_MIB * 1024 * 1024;
    let chunk = random_bytes(CHUNK_MIB * 1024 * 1024);
    write_file(&blob, &chunk);
    copy_into_session(&site, &blob);
    let gateway = Target::gateway(&site, &user);
    let reference = Target::sshd(&sshd, &blob);

    println!(
        "==> throughput, {} MiB each way, {} runs, the median of each run's ratio",
        bytes / 1024 / 1024,
        options.runs
    );
    let mut rates = [[Vec::new(), Vec::new()], [Vec::new(), Vec::new()]]; // [target][up, down]
    for run in 1..=options.runs {
        for (i, target) in [&gateway, &reference].into_iter().enumerate() {
            let up = mib_per_s(bytes, upload(target, &chunk, repeats));
            let down = mib_per_s(bytes, download(target, repeats, bytes));
            println!(
                "run {run}  {:<8} up {up:>7.1} MiB/s  down {down:>7.1} MiB/s",
                target.name
            );
            rates[i][0].push(up);
            rates[i][1].push(down);
        }
    }
    for (j, way) in ["up (client to server)", "down (server to client)"]
        .into_iter()
        .enumerate()
    {
        let ratios: Vec<f64> = rates[0][j]
            .iter()
            .zip(&rates[1][j])
            .map(|(ours, theirs)| ours / theirs)
            .collect();
        let (ours, theirs, ratio) = (median(&rates[0][j]), median(&rates[1][j]), median(&ratios));
        let each: Vec<String> = ratios.iter().map(|r| format!("{r:.3}")).collect();
        println!(
            "{way}: gateway {ours:.1} MiB/s, sshd {theirs:.1} MiB/s (medians); ratio {ratio:.3} \
             (the median of {})",
            each.join(", ")
        );
        bench_summary(
            &format!("SSH throughput {way}, MiB/s"),
            &format!("{ours:.1}"),
            &format!("{theirs:.1}"),
            Some(ratio),
        );
    }

    println!(
        "\n==> login: `ssh T true`, {} one after the other",
        options.logins
    );
    let mut times = [Vec::new(), Vec::new()];
    for _ in 0..options.logins {
        for (i, target) in [&gateway, &reference].into_iter().enumerate() {
            times[i].push(login(target));
        }
    }
    for samples in &mut times {
        samples.sort();
    }
    for (i, target) in [&gateway, &reference].into_iter().enumerate() {
        println!(
            "{:<8} p50 {} ms, p99 {} ms",
            target.name,
            ms(percentile(&times[i], 50)),
            ms(percentile(&times[i], 99))
        );
    }
    let (ours, theirs) = (percentile(&times[0], 50), percentile(&times[1], 50));
    bench_summary(
        "SSH login (ssh T true) p50, ms",
        &ms(ours).to_string(),
        &ms(theirs).to_string(),
        Some(ours.as_secs_f64() / theirs.as_secs_f64()),
    );

    println!("\n==> login: {} `ssh T true` at once", options.concurrent);
    let mut walls = [Duration::ZERO; 2];
    for (i, target) in [&gateway, &reference].into_iter().enumerate() {
        walls[i] = logins_at_once(target, options.concurrent);
        println!(
            "{:<8} all {} done in {} ms",
            target.name,
            options.concurrent,
            ms(walls[i])
        );
    }
    bench_summary(
        &format!("{} logins at once, wall ms", options.concurrent),
        &ms(walls[0]).to_string(),
        &ms(walls[1]).to_string(),
        Some(walls[0].as_secs_f64() / walls[1].as_secs_f64()),
    );

    if options.idle > 0 {
        println!(
            "\n==> {} idle connections to the gateway (authenticated, a session channel open)",
            options.idle
        );
        idle_connections(&site, &user, options.idle, options.idle_rounds);
    }
    if options.active > 0 {
        println!(
            "\n==> {} active connections at once, each `head -c {ACTIVE_MIB}M FILE`",
            options.active
        );
        let pids = ["gateway", "agent"].map(|c| site.pid(c).expect("the site's processes run"));
        let mut walls = [Duration::ZERO; 2];
        for (i, target) in [&gateway, &reference].into_iter().enumerate() {
            let (wall, peak) = active_at_once(target, options.active, &pids);
            walls[i] = wall;
            println!(
                "{:<8} all {} done in {} ms ({:.1} MiB/s in all); highest resident memory \
                 meanwhile: gateway {:.1} MiB, agent {:.1} MiB",
                target.name,
                options.active,
                ms(wall),
                (options.active as u64 * ACTIVE_MIB) as f64 / wall.as_secs_f64(),
                peak[0] as f64 / 1024.0,
                peak[1] as f64 / 1024.0
            );
            if i == 0 {
                bench_summary(
                    &format!(
                        "gateway / agent highest memory, {} active, MiB",
                        options.active
                    ),
                    &format!(
                        "{:.1} / {:.1}",
                        peak[0] as f64 / 1024.0,
                        peak[1] as f64 / 1024.0
                    ),
                    "-",
                    None,
                );
            }
        }
        bench_summary(
            &format!(
                "{} active connections (4 MiB each), wall ms",
                options.active
            ),
            &ms(walls[0]).to_string(),
            &ms(walls[1]).to_string(),
            Some(walls[0].as_secs_f64() / walls[1].as_secs_f64()),
        );
    }

    std::fs::remove_file(&blob).ok();
    ExitCode::SUCCESS
}

/// The site every gateway measurement uses: one user with a key and the running session
/// [`SESSION`]; with metrics, since the idle rounds read the gateway's count of open
/// connections.
fn bench_site() -> (Site, User) {
    let mut site = Site::start_with_metrics(&[SimGpu::a100(1)]);
    let user = site.user("Bench");
    site.allow_loopback();
    site.add_key(&user);
    site.devctl_ok(&user, &["session", "new", "--name", SESSION, "--wait"]);
    (site, user)
}

/// `bytes` random bytes.
fn random_bytes(bytes: u64) -> Vec<u8> {
    let mut buffer = vec![0u8; usize::try_from(bytes).expect("a chunk fits in memory")];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut random| random.read_exact(&mut buffer))
        .expect("read /dev/urandom");
    buffer
}

/// Writes `data` to `path`, readable by everyone (the sshd's user reads it).
fn write_file(path: &Path, data: &[u8]) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, data).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
}

/// Copies the random file into the session's container at [`CONTAINER_BLOB`], readable by the
/// session's user.
fn copy_into_session(site: &Site, blob: &Path) {
    let labels = [
        format!("label=ongrid.node={}", site.node),
        format!("label=ongrid.session.name={SESSION}"),
    ];
    let ids = docker_lines(&["ps", "-q", "--filter", &labels[0], "--filter", &labels[1]]);
    let [id] = ids.as_slice() else {
        panic!("expected one container for session {SESSION}, found {ids:?}");
    };
    let input = std::fs::File::open(blob).expect("open the random file");
    let status = Command::new("docker")
        .args(["exec", "-i", "--user", "0", id, "sh", "-c"])
        .arg(format!(
            "cat > {CONTAINER_BLOB} && chmod 0644 {CONTAINER_BLOB}"
        ))
        .stdin(input)
        .status()
        .expect("run docker exec");
    assert!(
        status.success(),
        "copying the random file into the container: {status}"
    );
}

/// `ssh T 'cat > /dev/null'` fed `chunk` `repeats` times: the time until ssh exits.
fn upload(target: &Target, chunk: &[u8], repeats: u64) -> Duration {
    let start = Instant::now();
    let mut child = target
        .command("cat > /dev/null")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run ssh");
    let mut input = child.stdin.take().expect("ssh stdin");
    let written = (0..repeats).try_for_each(|_| input.write_all(chunk));
    drop(input);
    let out = child.wait_with_output().expect("wait for ssh");
    let elapsed = start.elapsed();
    if let Err(error) = written {
        panic!(
            "upload through {} stopped reading ({error}, {}): {}",
            target.name,
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert!(
        out.status.success(),
        "upload through {} failed ({}): {}",
        target.name,
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    elapsed
}

/// `ssh T 'for i in $(seq REPEATS); do cat FILE; done'`, every byte counted: the time until ssh
/// exits.
fn download(target: &Target, repeats: u64, bytes: u64) -> Duration {
    let start = Instant::now();
    let mut child = target
        .command(&format!(
            "for i in $(seq {repeats}); do cat {}; done",
            target.blob
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run ssh");
    let mut stdout = child.stdout.take().expect("ssh stdout");
    let mut buffer = vec![0u8; 256 * 1024];
    let mut received = 0u64;
    loop {
        match stdout.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => received += n as u64,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => panic!("reading ssh's output: {e}"),
        }
    }
    let out = child.wait_with_output().expect("wait for ssh");
    let elapsed = start.elapsed();
    assert!(
        out.status.success() && received == bytes,
        "download through {} failed ({}, {received} of {bytes} bytes): {}",
        target.name,
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    elapsed
}

/// `ssh T true`: the time until ssh exits.
fn login(target: &Target) -> Duration {
    let start = Instant::now();
    let out = target
        .command("true")
        .stdin(Stdio::null())
        .output()
        .expect("run ssh");
    let elapsed = start.elapsed();
    assert!(
        out.status.success(),
        "ssh {} true failed ({}): {}",
        target.name,
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    elapsed
}

/// `count` `ssh T true` started together: the time until the last one exited.
fn logins_at_once(target: &Target, count: usize) -> Duration {
    let start = Instant::now();
    let children: Vec<Child> = (0..count)
        .map(|_| {
            target
                .command("true")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("run ssh")
        })
        .collect();
    let mut failures = Vec::new();
    for child in children {
        let out = child.wait_with_output().expect("wait for ssh");
        if !out.status.success() {
            failures.push(format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
    }
    let elapsed = start.elapsed();
    assert!(
        failures.is_empty(),
        "{} of {count} logins at once to {} failed: {failures:?}",
        failures.len(),
        target.name
    );
    elapsed
}

/// `count` connections open at once, each `ssh T 'echo ready; read go; head -c ACTIVE_MIB M
/// FILE'`: all are logged in first ([`ACTIVE_LOGINS`] at a time, under the gateway's cap of
/// logins in progress per address), then all are told to go together. The time from the go
/// until the last ended, every byte counted, and the highest resident memory (KiB) of each of
/// `pids` meanwhile.
fn active_at_once(target: &Target, count: usize, pids: &[u32; 2]) -> (Duration, [u64; 2]) {
    use std::io::BufRead;
    let bytes = ACTIVE_MIB * 1024 * 1024;
    let remote = format!("echo ready; read go; head -c {bytes} {}", target.blob);
    let mut open = Vec::with_capacity(count);
    for batch in (0..count).collect::<Vec<_>>().chunks(ACTIVE_LOGINS) {
        let children: Vec<Child> = batch
            .iter()
            .map(|_| {
                target
                    .command(&remote)
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("run ssh")
            })
            .collect();
        for mut child in children {
            let mut stdout = std::io::BufReader::new(child.stdout.take().expect("ssh stdout"));
            let mut line = String::new();
            stdout.read_line(&mut line).expect("read ssh's output");
            if line != "ready\n" {
                let out = child.wait_with_output().expect("wait for ssh");
                panic!(
                    "an active connection to {} did not log in ({}): {}",
                    target.name,
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            open.push((child, stdout));
        }
    }
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (done, pids) = (done.clone(), *pids);
        std::thread::spawn(move || {
            let mut peak = [0_u64; 2];
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                for (i, pid) in pids.iter().enumerate() {
                    peak[i] = peak[i].max(rss_kib(*pid).unwrap_or(0));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            peak
        })
    };
    let start = Instant::now();
    let readers: Vec<_> = open
        .into_iter()
        .map(|(mut child, mut stdout)| {
            let mut stdin = child.stdin.take().expect("ssh stdin");
            std::thread::spawn(move || {
                let went = stdin.write_all(b"go\n");
                drop(stdin);
                let received = std::io::copy(&mut stdout, &mut std::io::sink()).unwrap_or(0);
                let out = child.wait_with_output().expect("wait for ssh");
                (went.is_ok() && out.status.success() && received == bytes)
                    .then_some(())
                    .ok_or_else(|| {
                        format!(
                            "{} ({received} of {bytes} bytes): {}",
                            out.status,
                            String::from_utf8_lossy(&out.stderr).trim()
                        )
                    })
            })
        })
        .collect();
    let failures: Vec<String> = readers
        .into_iter()
        .filter_map(|reader| reader.join().expect("reader thread").err())
        .collect();
    let elapsed = start.elapsed();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let peak = sampler.join().expect("sampler thread");
    assert!(
        failures.is_empty(),
        "{} of {count} active connections to {} failed, first: {}",
        failures.len(),
        target.name,
        failures[0]
    );
    (elapsed, peak)
}

/// A client that accepts any host key (the harness's gateway made its own just now).
struct TrustingClient;

impl russh::client::Handler for TrustingClient {
    type Error = russh::Error;

    async fn check_server_key(
        &mut self,
        _key: &russh::keys::PublicKeyOrCertificate,
    ) -> Result<bool, Self::Error> {
        Ok(true)
    }
}

/// An idle connection: its handle and its open session channel, kept until dropped.
type Idle = (
    russh::client::Handle<TrustingClient>,
    russh::Channel<russh::client::Msg>,
);

/// One connection to the gateway, authenticated as the user, with a session channel open.
async fn connect_idle(
    config: Arc<russh::client::Config>,
    addr: String,
    key: Arc<russh::keys::PrivateKey>,
) -> Result<Idle, String> {
    let mut handle = russh::client::connect(config, addr.as_str(), TrustingClient)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let auth = handle
        .authenticate_publickey(SESSION, russh::keys::PrivateKeyWithHashAlg::new(key, None))
        .await
        .map_err(|e| format!("authenticate: {e}"))?;
    if !auth.success() {
        return Err(format!("the gateway refused the key: {auth:?}"));
    }
    let channel = handle
        .channel_open_session()
        .await
        .map_err(|e| format!("open a session channel: {e}"))?;
    Ok((handle, channel))
}

/// `count` idle connections opened, held, then closed, `rounds` times in the one gateway: the
/// resident memory of the gateway and the agent before, with all open, and after each round
/// closed (once the gateway holds no more file descriptors than before, so the connections
/// are gone from it, not only from this side). Memory still held after a round is either
/// leaked or kept by the allocator for reuse: a leak grows again with every round, memory kept
/// for reuse is taken again by the next round and the figure after it stays where it was.
fn idle_connections(site: &Site, user: &User, count: usize, rounds: usize) {
    let pids = ["gateway", "agent"].map(|c| site.pid(c).expect("the site's processes run"));
    let rss = || pids.map(|pid| rss_kib(pid).expect("the process runs"));
    let before = rss();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let addr = site.gateway_addr.clone().expect("the gateway runs");
    let key = Arc::new(
        russh::keys::load_secret_key(&user.ssh_key, None).expect("load the user's SSH key"),
    );
    let config = Arc::new(russh::client::Config::default());
    let mut first_with = before;
    let mut afters = Vec::with_capacity(rounds);
    for round in 1..=rounds {
        let start = Instant::now();
        let held: Vec<Idle> = runtime.block_on(async {
            let limit = Arc::new(tokio::sync::Semaphore::new(IDLE_IN_FLIGHT));
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..count {
                let (config, addr, key, limit) =
                    (config.clone(), addr.clone(), key.clone(), limit.clone());
                tasks.spawn(async move {
                    let _permit = limit.acquire_owned().await.expect("never closed");
                    connect_idle(config, addr, key).await
                });
            }
            let mut held = Vec::with_capacity(count);
            let mut failures = Vec::new();
            while let Some(done) = tasks.join_next().await {
                match done.expect("connection task") {
                    Ok(idle) => held.push(idle),
                    Err(error) => failures.push(error),
                }
            }
            assert!(
                failures.is_empty(),
                "{} of {count} idle connections failed, first: {}\n{}",
                failures.len(),
                failures[0],
                site.logs()
            );
            held
        });
        let opened_in = start.elapsed();
        let with = rss();
        if round == 1 {
            first_with = with;
        }
        let per = |i: usize| (with[i] as f64 - before[i] as f64) / count as f64;
        println!(
            "round {round}: opened {count} in {:.1} s; resident memory before / with {count}: \
             gateway {} / {} KiB ({:.1} KiB each), agent {} / {} KiB ({:.1} KiB each)",
            opened_in.as_secs_f64(),
            before[0],
            with[0],
            per(0),
            before[1],
            with[1],
            per(1)
        );
        runtime.block_on(async move {
            for (handle, channel) in held {
                drop(channel);
                let _ = handle
                    .disconnect(russh::Disconnect::ByApplication, "", "")
                    .await;
            }
        });
        // Measured once the gateway has let go of every connection: its own gauge of open
        // connections is back to 0 (its pool of connections to the manager stays, as it should).
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let open = gateway_connections_open(site);
            if open == Some(0) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the gateway still counts {open:?} connections open a minute after the {count} \
                 connections closed\n{}",
                site.logs()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let after = rss();
        println!(
            "round {round}: after they closed: gateway {} KiB, agent {} KiB",
            after[0], after[1]
        );
        afters.push(after);
    }
    drop(runtime);
    let per = (first_with[0] as f64 - before[0] as f64) / count as f64;
    bench_summary(
        &format!("gateway memory per idle connection ({count}), KiB"),
        &format!("{per:.1}"),
        "-",
        None,
    );
    bench_summary(
        &format!("gateway / agent resident memory with {count} idle, MiB"),
        &format!(
            "{:.1} / {:.1}",
            first_with[0] as f64 / 1024.0,
            first_with[1] as f64 / 1024.0
        ),
        "-",
        None,
    );
    let mib = |kib: u64| format!("{:.1}", kib as f64 / 1024.0);
    let gateway_afters: Vec<String> = afters.iter().map(|a| mib(a[0])).collect();
    bench_summary(
        &format!(
            "gateway resident memory before / after each of {rounds} rounds of {count} idle, MiB"
        ),
        &format!("{} / {}", mib(before[0]), gateway_afters.join(" / ")),
        "-",
        None,
    );
    if let (Some(first), Some(last)) = (afters.first(), afters.last()) {
        if rounds > 1 {
            let growth = (last[0] as f64 - first[0] as f64) / ((rounds - 1) * count) as f64;
            println!(
                "gateway growth from round 1 to round {rounds}: {growth:.2} KiB per connection \
                 (against {per:.1} KiB each while open)"
            );
            bench_summary(
                &format!("gateway growth per closed connection after round 1 ({count}), KiB"),
                &format!("{growth:.2}"),
                "-",
                None,
            );
        }
    }
}

/// `ongrid_gateway_connections_open` as the gateway's `/metrics` says it now (`curl`, Debian's,
/// on loopback); `None` when it cannot be read.
fn gateway_connections_open(site: &Site) -> Option<u64> {
    let addr = site.metrics_addrs.get("gateway")?;
    let out = Command::new("curl")
        .args(["-sf", "--max-time", "5", &format!("http://{addr}/metrics")])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|line| line.strip_prefix("ongrid_gateway_connections_open "))?
        .trim()
        .parse()
        .ok()
}

fn mib_per_s(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / (1024.0 * 1024.0) / elapsed.as_secs_f64()
}

/// The median of `values` (the mean of the middle two for an even count).
fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let middle = sorted.len() / 2;
    if sorted.len().is_multiple_of(2) {
        (sorted[middle - 1] + sorted[middle]) / 2.0
    } else {
        sorted[middle]
    }
}

/// The nearest-rank percentile of sorted samples.
fn percentile(sorted: &[Duration], p: usize) -> Duration {
    let rank = (p * sorted.len()).div_ceil(100).max(1);
    sorted[rank - 1]
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}
