//! Time to shell: how long a person waits from `devctl session new --wait` to the first command
//! run through the SSH gateway in the new session (`ssh <session>@gateway true`), over a number
//! of sessions, on a site of the real binaries (manager, agent with a simulated GPU, gateway)
//! brought up by the end-to-end harness, with a GPU free and the dev image present.
//!
//! ```text
//! cargo build --release --workspace --bins
//! cargo run --release -p ongrid-e2e --example time_to_shell -- [SESSIONS]
//! ONGRID_BENCH_SSHD_PORT=P ONGRID_BENCH_SSHD_USER=U ONGRID_BENCH_SSHD_KEY=K \
//!     cargo run --release -p ongrid-e2e --example time_to_shell -- --burst [SESSIONS]
//! ```
//!
//! One after the other (the default): each round creates a session, waits for it, logs in once
//! and runs `true`, then removes it and waits for its container to be gone.
//! A first round, not counted, gives the user a home volume (made once per user). Prints every
//! round, then p50 and p99 (nearest rank) of the whole and of its two parts: `devctl session
//! new --wait` (request → container running and reported) and the SSH login with the command;
//! the first two also to `bench/run.sh`'s table ([`bench_summary`]).
//!
//! A burst (`--burst`, default 60 sessions): a class arriving at 9:00. All sessions are asked
//! for at once (`devctl session new --share shared --wait`, then `ssh <session>@gateway true`,
//! one thread each, released together), on one node whose simulated GPUs are in `shared:32`
//! mode, enough shares for all; the time to shell of each is from its request to the end of
//! its first command. Beside it, in the same run and first, the floor: as many `docker run -d`
//! of the dev image at once, each followed by one `ssh <user>@127.0.0.1 true` to a plain sshd
//! (bench/run.sh starts one and sets `ONGRID_BENCH_SSHD_*`). Prints p50, p99 and the slowest
//! of both and the ratio of the p99s, to the table too. `ONGRID_BENCH_LOGS=DIR` keeps the
//! site's logs there.

use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use ongrid_e2e::{
    bench_summary, docker_lines, ssh_client_options, unique_suffix, SimGpu, Site, User, DEV_IMAGE,
};

const DEFAULT_SESSIONS: usize = 20;
const DEFAULT_BURST: usize = 60;
/// Sessions per simulated GPU in a burst (`shared:32`); the burst gets as many GPUs as it needs.
const SHARES_PER_GPU: usize = 32;

const USAGE: &str = "usage: time_to_shell [SESSIONS] | time_to_shell --burst [SESSIONS]  \
                     (a whole number of sessions, like 20)";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (burst, count) = match args.as_slice() {
        [flag, rest @ ..] if flag == "--burst" => (true, rest.first()),
        rest => (false, rest.first()),
    };
    if args.len() > usize::from(burst) + 1 {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    }
    let sessions = match count.map(|a| a.parse::<usize>()) {
        None if burst => DEFAULT_BURST,
        None => DEFAULT_SESSIONS,
        Some(Ok(n)) if n > 0 => n,
        Some(_) => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    if burst {
        return self::burst(sessions);
    }
    let mut site = Site::start(&[SimGpu::a100(1)]);
    let user = site.user("Bench");
    site.allow_loopback();
    site.add_key(&user);

    // The user's home volume is made on their first session: not what a returning user waits.
    round(&site, &user, "warmup", &[]);
    let mut total = Vec::new();
    let mut waits = Vec::new();
    let mut logins = Vec::new();
    println!("round  new --wait  ssh true  total");
    for i in 1..=sessions {
        let (wait, login) = round(&site, &user, &format!("bench{i}"), &[]);
        println!(
            "{i:>5}  {:>10}  {:>8}  {:>5}",
            ms(wait),
            ms(login),
            ms(wait + login)
        );
        waits.push(wait);
        logins.push(login);
        total.push(wait + login);
    }
    println!();
    for (what, samples) in [
        ("time to shell", &mut total),
        ("  devctl session new --wait", &mut waits),
        ("  ssh login + true", &mut logins),
    ] {
        samples.sort();
        println!(
            "{what}: p50 {} ms, p99 {} ms (n = {})",
            ms(percentile(samples, 50)),
            ms(percentile(samples, 99)),
            samples.len()
        );
    }
    for (what, samples) in [
        ("time to shell", &total),
        ("  devctl session new --wait", &waits),
    ] {
        bench_summary(
            &format!("{} p50 / p99 ({sessions}), ms", what.trim()),
            &format!(
                "{} / {}",
                ms(percentile(samples, 50)),
                ms(percentile(samples, 99))
            ),
            "-",
            None,
        );
    }
    ExitCode::SUCCESS
}

/// One session: created and waited for, one login running `true`, removed. The two times.
fn round(site: &Site, user: &User, name: &str, new_args: &[&str]) -> (Duration, Duration) {
    let (running, login) = shell(site, user, name, new_args);
    site.devctl_ok(user, &["session", "rm", name]);
    // The next round starts on an idle node, as a person's request usually does.
    let labels = [
        format!("label=ongrid.node={}", site.node),
        format!("label=ongrid.session.name={name}"),
    ];
    site.wait_until("the container removed", Duration::from_secs(60), || {
        let listed = docker_lines(&["ps", "-aq", "--filter", &labels[0], "--filter", &labels[1]]);
        listed.is_empty().then_some(())
    });
    (running, login)
}

/// `devctl session new --name NAME --wait NEW_ARGS`, then `ssh NAME@gateway true`: how long
/// each took.
fn shell(site: &Site, user: &User, name: &str, new_args: &[&str]) -> (Duration, Duration) {
    let start = Instant::now();
    let mut args = vec!["session", "new", "--name", name, "--wait"];
    args.extend_from_slice(new_args);
    site.devctl_ok(user, &args);
    let running = start.elapsed();
    let out = site.ssh(user, name, "true", b"");
    let login = start.elapsed() - running;
    assert!(
        out.status.success(),
        "ssh {name}@gateway true failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        site.logs()
    );
    (running, login)
}

/// The plain sshd of the reference, as bench/run.sh started it.
struct PlainSshd {
    port: String,
    user: String,
    key: PathBuf,
}

impl PlainSshd {
    fn from_env() -> Option<Self> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        Some(Self {
            port: var("ONGRID_BENCH_SSHD_PORT")?,
            user: var("ONGRID_BENCH_SSHD_USER")?,
            key: var("ONGRID_BENCH_SSHD_KEY")?.into(),
        })
    }
}

/// The reference's containers, removed when dropped (also when the bench fails).
struct ReferenceContainers {
    label: String,
}

impl Drop for ReferenceContainers {
    fn drop(&mut self) {
        let ids = docker_lines(&["ps", "-aq", "--filter", &format!("label={}", self.label)]);
        if !ids.is_empty() {
            let _ = Command::new("docker")
                .args(["rm", "-f"])
                .args(&ids)
                .stdout(Stdio::null())
                .status();
        }
    }
}

/// `sessions` sessions asked for at once on one node with shared GPUs, beside the floor of
/// `docker run -d` and a plain sshd at the same concurrency. See the module documentation.
fn burst(sessions: usize) -> ExitCode {
    let Some(sshd) = PlainSshd::from_env() else {
        eprintln!(
            "the burst's reference needs a plain sshd: set ONGRID_BENCH_SSHD_PORT, \
             ONGRID_BENCH_SSHD_USER and ONGRID_BENCH_SSHD_KEY (bench/run.sh does)"
        );
        return ExitCode::from(2);
    };
    println!("reference: {sessions} × (docker run -d {DEV_IMAGE} + ssh true to sshd), at once");
    let reference = {
        let containers = ReferenceContainers {
            label: format!("ongrid-bench-reference={}", unique_suffix()),
        };
        let label = &containers.label;
        all_at_once(sessions, |i| {
            let start = Instant::now();
            let out = Command::new("docker")
                .args([
                    "run", "-d", "--label", label, DEV_IMAGE, "sleep", "infinity",
                ])
                .output()
                .expect("run docker");
            assert!(
                out.status.success(),
                "docker run -d {DEV_IMAGE} ({i}) failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let running = start.elapsed();
            let out = Command::new("ssh")
                .args(ssh_client_options(&sshd.port, &sshd.key))
                .arg(format!("{}@127.0.0.1", sshd.user))
                .arg("true")
                .stdin(Stdio::null())
                .output()
                .expect("run ssh");
            assert!(
                out.status.success(),
                "ssh to the reference sshd ({i}) failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            (running, start.elapsed() - running)
        })
    };
    report("  docker run -d", "  ssh login + true", &reference);

    let gpus: Vec<SimGpu> = (1..=sessions.div_ceil(SHARES_PER_GPU))
        .map(|n| SimGpu::a100(u8::try_from(n).expect("at most 255 GPUs")))
        .collect();
    let mut site = Site::start(&gpus);
    let admin = site.admin.clone();
    for gpu in &gpus {
        let mode = format!("shared:{SHARES_PER_GPU}");
        site.devctl_ok(&admin, &["admin", "gpu", "mode", &gpu.uuid, &mode]);
    }
    let user = site.user("Burst");
    site.allow_loopback();
    site.add_key(&user);
    // The user's home volume is made on their first session: not what a class waits for
    // (their homes exist from the first lesson).
    round(&site, &user, "warmup", &["--share", "shared"]);
    println!(
        "\nongrid: {sessions} × (devctl session new --share shared --wait + ssh true), at once, \
         on {} simulated GPUs in shared:{SHARES_PER_GPU} mode",
        gpus.len()
    );
    let ongrid = all_at_once(sessions, |i| {
        shell(&site, &user, &format!("burst{i}"), &["--share", "shared"])
    });
    report("  devctl session new --wait", "  ssh login + true", &ongrid);
    if let Some(dir) = std::env::var_os("ONGRID_BENCH_LOGS") {
        // For a look at where the time went: the site's directory goes with it.
        for name in ["manager", "agent", "gateway"] {
            let file = format!("{name}.log");
            let _ = std::fs::copy(site.dir.path().join(&file), PathBuf::from(&dir).join(file));
        }
    }

    let ours = percentiles(&ongrid);
    let floor = percentiles(&reference);
    let ratio = ours.1.as_secs_f64() / floor.1.as_secs_f64();
    println!(
        "\nburst time to shell p99: ongrid {} ms, reference {} ms: {ratio:.2}× (target ≤ 1.5×)",
        ms(ours.1),
        ms(floor.1)
    );
    let show = |(p50, p99, max): (Duration, Duration, Duration)| {
        format!("{} / {} / {}", ms(p50), ms(p99), ms(max))
    };
    bench_summary(
        &format!("burst time to shell p50 / p99 / max ({sessions} at once), ms"),
        &show(ours),
        &show(floor),
        Some(ratio),
    );
    ExitCode::SUCCESS
}

/// Runs `job(0..n)` on `n` threads released together; each job's two times, in order of `i`.
fn all_at_once(
    n: usize,
    job: impl Fn(usize) -> (Duration, Duration) + Sync,
) -> Vec<(Duration, Duration)> {
    let barrier = Barrier::new(n);
    std::thread::scope(|scope| {
        let threads: Vec<_> = (1..=n)
            .map(|i| {
                let (barrier, job) = (&barrier, &job);
                scope.spawn(move || {
                    barrier.wait();
                    job(i)
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("a burst thread panicked"))
            .collect()
    })
}

/// Prints p50, p99 and the slowest of the whole and of its two parts.
fn report(first: &str, second: &str, samples: &[(Duration, Duration)]) {
    for (what, mut values) in [
        (
            "time to shell",
            samples.iter().map(|(a, b)| *a + *b).collect::<Vec<_>>(),
        ),
        (first, samples.iter().map(|(a, _)| *a).collect()),
        (second, samples.iter().map(|(_, b)| *b).collect()),
    ] {
        values.sort();
        println!(
            "{what}: p50 {} ms, p99 {} ms, max {} ms (n = {})",
            ms(percentile(&values, 50)),
            ms(percentile(&values, 99)),
            ms(*values.last().expect("samples")),
            values.len()
        );
    }
}

/// p50, p99 and the slowest time to shell.
fn percentiles(samples: &[(Duration, Duration)]) -> (Duration, Duration, Duration) {
    let mut total: Vec<Duration> = samples.iter().map(|(a, b)| *a + *b).collect();
    total.sort();
    (
        percentile(&total, 50),
        percentile(&total, 99),
        *total.last().expect("samples"),
    )
}

/// The nearest-rank percentile of sorted samples.
fn percentile(sorted: &[Duration], p: usize) -> Duration {
    let rank = (p * sorted.len()).div_ceil(100).max(1);
    sorted[rank - 1]
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}
