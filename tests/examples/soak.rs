//! Soak: many SSH connections held open and busy while sessions start and go away, for minutes,
//! on a site of the real binaries (manager, an agent with simulated GPUs, the gateway) brought up
//! by the end-to-end harness. Run through `bench/soak.sh`, which builds it and cleans up after a
//! Ctrl-C.
//!
//! ```text
//! soak [--minutes 10] [--connections 200] [--starts-per-minute 50] [--interval 60]
//!      [--quiet-starts 10]
//! ```
//!
//! The node has four simulated A100s in `shared:64` mode; every session asks for a share of one
//! GPU. The held connections go to `ceil(connections / 20)` long-lived sessions of one user. Each
//! connection is a real OpenSSH client running a remote echo loop: it logs in (the login time is
//! from the start of `ssh` to the remote side's first line), sends a line every two seconds and
//! waits for it back (the echo time), and after a lifetime of 30 to 90 seconds closes its input,
//! expects exit status 0 and connects again. Meanwhile a second user starts
//! `--starts-per-minute` sessions a minute, evenly spaced: `devctl session new --wait` (the
//! start time), one `ssh <session>@gateway true`, `devctl session rm` (the removal time).
//!
//! Before any of that, on the idle site, the same user starts and removes `--quiet-starts`
//! sessions one after another: their start times are the quiet reference. The end of the run
//! prints each interval's start p50 against the quiet p50, the worst of those ratios, and the
//! whole run's; the soak keeps its start p50 within 2x the quiet p50 when the worst is at most 2.
//! It prints the ratios and asserts nothing about them.
//!
//! Every `--interval` seconds it prints the counts and the p50/p95/p99 of each time, the errors
//! of the interval by kind, the resident memory of the manager, the agent and the gateway, and
//! the site's containers; at the end the same over the whole run. An error is anything that did
//! not go as a user would expect: a failed login or command, an unexpected exit status, an echo
//! that did not come back within 30 s, a start that failed or timed out, a removal that failed.
//! The exit status is 1 when there was any error.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ongrid_e2e::{binary, docker_lines, SimGpu, Site, User};

/// Connections per long-lived session.
const CONNECTIONS_PER_SESSION: usize = 20;
/// Time between two echo lines of one connection.
const ECHO_EVERY: Duration = Duration::from_secs(2);
/// An echo or login not answered within this long is an error (the connection is then killed).
const STALL: Duration = Duration::from_secs(30);
/// How long the held connections take to open at the start (spread evenly).
const RAMP_UP: Duration = Duration::from_secs(20);
/// Shares per simulated GPU, and GPUs.
const SHARES: u32 = 64;
const GPUS: u8 = 4;

struct Options {
    minutes: f64,
    connections: usize,
    starts_per_minute: f64,
    interval: Duration,
    quiet_starts: usize,
}

fn usage() -> String {
    "usage: soak [--minutes N] [--connections N] [--starts-per-minute N] [--interval SECONDS]\n\
     \x20           [--quiet-starts N]\n\
     (defaults: 10 minutes, 200 connections, 50 starts a minute, a report every 60 s, 10 starts \
     on the idle site first)"
        .to_owned()
}

fn parse_options() -> Result<Options, String> {
    let mut options = Options {
        minutes: 10.0,
        connections: 200,
        starts_per_minute: 50.0,
        interval: Duration::from_secs(60),
        quiet_starts: 10,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n{}", usage()))?;
        let number: f64 = value
            .parse()
            .ok()
            .filter(|n: &f64| n.is_finite() && *n >= 0.0)
            .ok_or_else(|| format!("{flag} {value}: not a number of zero or more\n{}", usage()))?;
        match flag.as_str() {
            "--minutes" if number > 0.0 => options.minutes = number,
            "--connections" => options.connections = number as usize,
            "--starts-per-minute" => options.starts_per_minute = number,
            "--interval" if number >= 1.0 => options.interval = Duration::from_secs_f64(number),
            "--quiet-starts" => options.quiet_starts = number as usize,
            "--minutes" | "--interval" => {
                return Err(format!(
                    "{flag} {value}: must be more than zero\n{}",
                    usage()
                ))
            }
            _ => return Err(format!("unknown option {flag}\n{}", usage())),
        }
    }
    Ok(options)
}

/// What happened during one interval (and, merged, during the whole run).
#[derive(Default, Clone)]
struct Samples {
    logins: Vec<Duration>,
    echoes: Vec<Duration>,
    starts: Vec<Duration>,
    removals: Vec<Duration>,
    errors: BTreeMap<String, u64>,
}

impl Samples {
    fn merge(&mut self, other: &Samples) {
        self.logins.extend(&other.logins);
        self.echoes.extend(&other.echoes);
        self.starts.extend(&other.starts);
        self.removals.extend(&other.removals);
        for (kind, n) in &other.errors {
            *self.errors.entry(kind.clone()).or_default() += n;
        }
    }

    fn error_count(&self) -> u64 {
        self.errors.values().sum()
    }
}

#[derive(Default)]
struct Shared {
    now: Mutex<Samples>,
    stop: AtomicBool,
    /// Stop starting new sessions (the churn ends before the held connections do).
    stop_starts: AtomicBool,
    open: AtomicU64,
}

impl Shared {
    fn record(&self, f: impl FnOnce(&mut Samples)) {
        f(&mut self.now.lock().expect("samples lock"));
    }

    fn error(&self, kind: &str, detail: &str) {
        eprintln!("error: {kind}: {}", detail.trim());
        self.record(|s| *s.errors.entry(kind.to_owned()).or_default() += 1);
    }

    fn take(&self) -> Samples {
        std::mem::take(&mut self.now.lock().expect("samples lock"))
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }
}

fn main() -> ExitCode {
    let options = match parse_options() {
        Ok(o) => o,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    let gpus: Vec<SimGpu> = (1..=GPUS).map(SimGpu::a100).collect();
    let mut site = Site::start(&gpus);
    // For bench/soak.sh: what to clean up if this process is killed before its site is dropped.
    if let Some(path) = std::env::var_os("ONGRID_SOAK_STATE") {
        let state = format!("{}\n{}\n", site.node, site.dir.path().display());
        if let Err(e) = std::fs::write(&path, state) {
            eprintln!("cannot write {}: {e}", Path::new(&path).display());
            return ExitCode::FAILURE;
        }
    }
    println!(
        "==> site: node {}, files in {}",
        site.node,
        site.dir.path().display()
    );
    use_site_timeouts(&mut site);
    for gpu in &gpus {
        site.devctl_ok(
            &site.admin,
            &[
                "admin",
                "gpu",
                "mode",
                &gpu.uuid,
                &format!("shared:{SHARES}"),
            ],
        );
    }
    let holder = site.user("Holder");
    let starter = site.user("Starter");
    site.allow_loopback();
    site.add_key(&holder);
    site.add_key(&starter);

    let quiet = quiet_starts(&site, &starter, options.quiet_starts);
    if quiet.error_count() > 0 {
        println!("errors: {}", quiet.error_count());
        eprintln!("{}", site.logs());
        return ExitCode::FAILURE;
    }
    let quiet_p50 = median(&quiet.starts);

    let sessions = options.connections.div_ceil(CONNECTIONS_PER_SESSION);
    println!(
        "==> {sessions} long-lived sessions for {} connections",
        options.connections
    );
    for i in 0..sessions {
        site.devctl_ok(
            &holder,
            &[
                "session",
                "new",
                "--name",
                &format!("hold{i}"),
                "--share",
                "shared",
                "--wait",
            ],
        );
    }

    let site = Arc::new(site);
    let shared = Arc::new(Shared::default());
    let started = Instant::now();
    let duration = Duration::from_secs_f64(options.minutes * 60.0);
    println!(
        "==> soak: {} min, {} connections, {} session starts a minute, a report every {} s",
        options.minutes,
        options.connections,
        options.starts_per_minute,
        options.interval.as_secs()
    );

    let mut threads = Vec::new();
    for i in 0..options.connections {
        let (site, shared, user) = (site.clone(), shared.clone(), holder.clone());
        let target = format!("hold{}", i / CONNECTIONS_PER_SESSION);
        let delay = RAMP_UP.mul_f64(i as f64 / options.connections.max(1) as f64);
        threads.push(std::thread::spawn(move || {
            std::thread::sleep(delay);
            let mut round = 0u64;
            while !shared.stopping() {
                // 30 to 90 s, different for each connection and round.
                let lifetime = Duration::from_secs(30 + (i as u64 * 7919 + round * 104_729) % 61);
                hold_connection(&site, &shared, &user, &target, lifetime);
                round += 1;
            }
        }));
    }
    let starts = {
        let (site, shared, user) = (site.clone(), shared.clone(), starter.clone());
        let every = (options.starts_per_minute > 0.0)
            .then(|| Duration::from_secs_f64(60.0 / options.starts_per_minute));
        std::thread::spawn(move || {
            let mut workers = Vec::new();
            let Some(every) = every else { return };
            let begin = Instant::now();
            let mut n = 0u32;
            while !shared.stop_starts.load(Ordering::Relaxed) {
                let (site, worker_shared, user) = (site.clone(), shared.clone(), user.clone());
                let name = format!("churn{n}");
                workers.push(std::thread::spawn(move || {
                    churn_session(&site, &worker_shared, &user, &name)
                }));
                n += 1;
                let next = begin + every * n;
                while Instant::now() < next && !shared.stop_starts.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            for worker in workers {
                let _ = worker.join();
            }
        })
    };

    let mut total = Samples::default();
    let mut interval_p50s = Vec::new();
    let mut next_report = options.interval;
    print_header();
    loop {
        let elapsed = started.elapsed();
        if elapsed >= duration {
            break;
        }
        std::thread::sleep((next_report.min(duration)).saturating_sub(elapsed));
        let interval = shared.take();
        report(&site, &shared, started.elapsed(), &interval);
        interval_p50s.extend(median(&interval.starts));
        total.merge(&interval);
        next_report += options.interval;
    }

    println!("==> stopping: the last session starts finish, then the connections close");
    shared.stop_starts.store(true, Ordering::Relaxed);
    let _ = starts.join();
    shared.stop.store(true, Ordering::Relaxed);
    for thread in threads {
        let _ = thread.join();
    }
    let last = shared.take();
    total.merge(&last);
    check_churn_gone(&site, &shared);
    total.merge(&shared.take());

    println!(
        "\n==> whole run ({:.1} min)",
        started.elapsed().as_secs_f64() / 60.0
    );
    print_header();
    report(&site, &shared, started.elapsed(), &total);
    compare_with_quiet(quiet_p50, &interval_p50s, median(&total.starts));
    let errors = total.error_count();
    if errors == 0 {
        println!("errors: 0");
        ExitCode::SUCCESS
    } else {
        println!("errors: {errors}");
        eprintln!("{}", site.logs());
        ExitCode::FAILURE
    }
}

/// The harness speeds tests up with a 1 s sync interval and a 10 s node timeout; a soak measures
/// a site as shipped, so the manager is restarted with the defaults of
/// `deploy/examples/manager.toml` (sync every 5 s, a node lost after 30 s without a sync).
fn use_site_timeouts(site: &mut Site) {
    site.stop_manager();
    let path = site.dir.path().join("manager.toml");
    let text = std::fs::read_to_string(&path).expect("read the manager's config");
    let text = text
        .replace(
            "node_timeout = \"10 seconds\"",
            "node_timeout = \"30 seconds\"",
        )
        .replace(
            "sync_interval = \"1 second\"",
            "sync_interval = \"5 seconds\"",
        );
    assert!(
        text.contains("node_timeout = \"30 seconds\"")
            && text.contains("sync_interval = \"5 seconds\""),
        "the harness's manager config changed: set node_timeout and sync_interval here again"
    );
    std::fs::write(&path, text).expect("write the manager's config");
    site.start_manager();
    let node = site.node.clone();
    site.wait_until("the node online again", Duration::from_secs(60), || {
        let nodes: serde_json::Value = site.devctl_json(&site.admin, &["gpus"]).ok()?;
        nodes
            .as_array()?
            .iter()
            .any(|n| n["name"] == node.as_str() && n["online"] == true)
            .then_some(())
    });
}

/// One connection: log in, echo every [`ECHO_EVERY`] for `lifetime`, close, check the exit.
fn hold_connection(site: &Site, shared: &Shared, user: &User, target: &str, lifetime: Duration) {
    let begin = Instant::now();
    let mut child = match site
        .ssh_command(user, target)
        .arg("-T")
        .arg("echo ready; while IFS= read -r line; do printf '%s\\n' \"$line\"; done")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(child) => child,
        Err(e) => {
            shared.error("ssh could not be run", &e.to_string());
            std::thread::sleep(Duration::from_secs(1));
            return;
        }
    };
    let pid = child.id();
    let mut input = child.stdin.take().expect("ssh stdin");
    let mut lines = BufReader::new(child.stdout.take().expect("ssh stdout")).lines();
    let stderr = child.stderr.take().expect("ssh stderr");
    let stderr = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut BufReader::new(stderr), &mut text);
        text
    });
    // A watchdog kills the client when an answer is late, so a stalled read ends (as an error).
    let waiting_since = Arc::new(AtomicU64::new(begin.elapsed().as_millis() as u64 + 1));
    let done = Arc::new(AtomicBool::new(false));
    let stalled = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let (waiting_since, done, stalled) = (waiting_since.clone(), done.clone(), stalled.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                let since = waiting_since.load(Ordering::Relaxed);
                let now = begin.elapsed().as_millis() as u64;
                if since != 0 && now.saturating_sub(since) > STALL.as_millis() as u64 {
                    stalled.store(true, Ordering::Relaxed);
                    let _ = Command::new("kill")
                        .args(["-KILL", &pid.to_string()])
                        .status();
                    return;
                }
                std::thread::sleep(Duration::from_millis(250));
            }
        })
    };
    let mut failed = None;
    match lines.next() {
        Some(Ok(line)) if line == "ready" => {
            shared.record(|s| s.logins.push(begin.elapsed()));
            shared.open.fetch_add(1, Ordering::Relaxed);
            let mut n = 0u64;
            while begin.elapsed() < lifetime && !shared.stopping() {
                waiting_since.store(0, Ordering::Relaxed);
                std::thread::sleep(ECHO_EVERY);
                n += 1;
                let line = format!("ping {target} {n}");
                let sent = Instant::now();
                waiting_since.store(begin.elapsed().as_millis() as u64 + 1, Ordering::Relaxed);
                if writeln!(input, "{line}")
                    .and_then(|()| input.flush())
                    .is_err()
                {
                    failed = Some("connection lost (write)");
                    break;
                }
                match lines.next() {
                    Some(Ok(echo)) if echo == line => {
                        shared.record(|s| s.echoes.push(sent.elapsed()));
                    }
                    Some(Ok(_)) => {
                        failed = Some("echo answered wrongly");
                        break;
                    }
                    _ => {
                        failed = Some("connection lost (read)");
                        break;
                    }
                }
            }
            shared.open.fetch_sub(1, Ordering::Relaxed);
        }
        Some(Ok(_)) => failed = Some("login answered wrongly"),
        _ => failed = Some("login failed"),
    }
    waiting_since.store(begin.elapsed().as_millis() as u64 + 1, Ordering::Relaxed);
    drop(input);
    let status = child.wait();
    done.store(true, Ordering::Relaxed);
    let _ = watchdog.join();
    let stderr = stderr.join().unwrap_or_default();
    if stalled.load(Ordering::Relaxed) {
        shared.error("no answer within 30 s", &format!("{target}: {stderr}"));
    } else if let Some(kind) = failed {
        shared.error(kind, &format!("{target}: {stderr}"));
    } else {
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => shared.error("unexpected exit status", &format!("{target}: {s} {stderr}")),
            Err(e) => shared.error("ssh could not be waited for", &e.to_string()),
        }
    }
    if failed.is_some() {
        // Do not spin on a broken site.
        std::thread::sleep(Duration::from_secs(5));
    }
}

/// One started session: created and waited for, one command through the gateway, removed.
fn churn_session(site: &Site, shared: &Shared, user: &User, name: &str) {
    let begin = Instant::now();
    let out = site.devctl(
        user,
        &[
            "session", "new", "--name", name, "--share", "shared", "--wait",
        ],
    );
    if !out.status.success() {
        shared.error(
            "session start failed",
            &format!("{name}: {}", String::from_utf8_lossy(&out.stderr)),
        );
    } else {
        shared.record(|s| s.starts.push(begin.elapsed()));
        let out = site
            .ssh_command(user, name)
            .arg("true")
            .stdin(Stdio::null())
            .output();
        match out {
            Ok(out) if out.status.success() => {}
            Ok(out) => shared.error(
                "command in a new session failed",
                &format!(
                    "{name}: {} {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                ),
            ),
            Err(e) => shared.error("ssh could not be run", &e.to_string()),
        }
    }
    let begin = Instant::now();
    let out = site.devctl(user, &["session", "rm", name]);
    if out.status.success() {
        shared.record(|s| s.removals.push(begin.elapsed()));
    } else {
        shared.error(
            "session removal failed",
            &format!("{name}: {}", String::from_utf8_lossy(&out.stderr)),
        );
    }
}

/// `count` sessions started and removed one after another on the idle site, as the churn
/// starts them: the quiet reference of the start time.
fn quiet_starts(site: &Site, user: &User, count: usize) -> Samples {
    if count == 0 {
        return Samples::default();
    }
    println!("==> quiet reference: {count} session starts one at a time on the idle site");
    let shared = Shared::default();
    for n in 0..count {
        churn_session(site, &shared, user, &format!("quiet{n}"));
    }
    let quiet = shared.take();
    println!(
        "quiet starts p50/p95/p99 ms: {} ({} of {count})",
        percentiles(&quiet.starts),
        quiet.starts.len()
    );
    quiet
}

/// Each interval's start p50 against the quiet one, the worst of them and the whole run's.
fn compare_with_quiet(quiet: Option<Duration>, intervals: &[Duration], whole: Option<Duration>) {
    let Some(quiet) = quiet.filter(|q| !q.is_zero()) else {
        println!("start p50 against the quiet p50: no quiet reference (--quiet-starts 0)");
        return;
    };
    let ratio = |p50: Duration| p50.as_secs_f64() / quiet.as_secs_f64();
    let each: Vec<String> = intervals
        .iter()
        .map(|p50| format!("{:.2}", ratio(*p50)))
        .collect();
    println!(
        "start p50 against the quiet p50 ({} ms), each interval: {}",
        quiet.as_millis(),
        each.join(" ")
    );
    if let Some(worst) = intervals.iter().max() {
        println!(
            "worst interval {} ms: {:.2}x the quiet p50 (target: at most 2)",
            worst.as_millis(),
            ratio(*worst)
        );
    }
    if let Some(whole) = whole {
        println!(
            "whole run {} ms: {:.2}x the quiet p50",
            whole.as_millis(),
            ratio(whole)
        );
    }
}

/// The median (nearest rank), `None` without samples.
fn median(samples: &[Duration]) -> Option<Duration> {
    nearest_rank(samples, &[50]).pop()
}

/// After the run the removed sessions' containers and networks must be gone (within 60 s).
fn check_churn_gone(site: &Site, shared: &Shared) {
    let node = format!("label=ongrid.node={}", site.node);
    let begin = Instant::now();
    loop {
        let containers: Vec<String> = docker_lines(&[
            "ps",
            "-a",
            "--filter",
            &node,
            "--format",
            "{{.Label \"ongrid.session.name\"}}",
        ])
        .into_iter()
        .filter(|name| name.starts_with("churn"))
        .collect();
        let networks = docker_lines(&["network", "ls", "-q", "--filter", &node]);
        if containers.is_empty() && networks.len() <= site_sessions(site) {
            return;
        }
        if begin.elapsed() > Duration::from_secs(60) {
            shared.error(
                "removed sessions left containers or networks",
                &format!("containers {containers:?}, {} networks", networks.len()),
            );
            return;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The site's long-lived sessions (each keeps its network).
fn site_sessions(site: &Site) -> usize {
    let node = format!("label=ongrid.node={}", site.node);
    docker_lines(&["ps", "-a", "-q", "--filter", &node]).len()
}

fn print_header() {
    println!(
        "{:>6} {:>5} | {:>5} {:>22} | {:>6} {:>16} | {:>4} {:>22} | {:>4} {:>16} | {:>6} | {:>24} | {:>4}",
        "time",
        "open",
        "login",
        "p50/p95/p99 ms",
        "echo",
        "p50/p95/p99 ms",
        "new",
        "p50/p95/p99 ms",
        "rm",
        "p50/p95/p99 ms",
        "errors",
        "RSS MiB mgr/agent/gw",
        "ctrs"
    );
}

fn report(site: &Site, shared: &Shared, at: Duration, samples: &Samples) {
    let rss = ["ongrid-manager", "ongrid-agent", "ongrid-gateway"]
        .map(|name| rss_mib(name, site.dir.path()).map_or("-".to_owned(), |m| format!("{m:.0}")));
    let containers = site_sessions(site);
    println!(
        "{:>5}s {:>5} | {:>5} {:>22} | {:>6} {:>16} | {:>4} {:>22} | {:>4} {:>16} | {:>6} | {:>24} | {:>4}",
        at.as_secs(),
        shared.open.load(Ordering::Relaxed),
        samples.logins.len(),
        percentiles(&samples.logins),
        samples.echoes.len(),
        percentiles(&samples.echoes),
        samples.starts.len(),
        percentiles(&samples.starts),
        samples.removals.len(),
        percentiles(&samples.removals),
        samples.error_count(),
        rss.join("/"),
        containers
    );
    for (kind, n) in &samples.errors {
        println!("        error: {kind}: {n}");
    }
}

/// `p50/p95/p99` in milliseconds (nearest rank), or `-` without samples.
fn percentiles(samples: &[Duration]) -> String {
    match nearest_rank(samples, &[50, 95, 99])[..] {
        [p50, p95, p99] => format!(
            "{}/{}/{}",
            p50.as_millis(),
            p95.as_millis(),
            p99.as_millis()
        ),
        _ => "-".to_owned(),
    }
}

/// The percentiles `ps` of `samples` by nearest rank; empty without samples.
fn nearest_rank(samples: &[Duration], ps: &[usize]) -> Vec<Duration> {
    let mut sorted = samples.to_vec();
    sorted.sort();
    if sorted.is_empty() {
        return Vec::new();
    }
    ps.iter()
        .map(|p| sorted[(p * sorted.len()).div_ceil(100).max(1) - 1])
        .collect()
}

/// The resident memory of this site's process of `binary_name` (its command line names a
/// config in the site's directory), from `/proc/<pid>/status`.
fn rss_mib(binary_name: &str, site_dir: &Path) -> Option<f64> {
    // By the command line, not /proc/<pid>/exe: a rebuild while the soak runs replaces the
    // binary, and exe then names a deleted file.
    let exe = binary(binary_name).to_string_lossy().into_owned();
    let site_dir = site_dir.to_string_lossy().into_owned();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let path = entry.path();
        let cmdline = std::fs::read(path.join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline);
        let mut words = cmdline.split('\0');
        if words.next() != Some(exe.as_str()) || !words.any(|w| w.contains(&site_dir)) {
            continue;
        }
        let status = std::fs::read_to_string(path.join("status")).ok()?;
        let kib: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        return Some(kib / 1024.0);
    }
    None
}
