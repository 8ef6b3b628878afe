//! Time to shell: how long a person waits from `devctl session new --wait` to the first command
//! run through the SSH gateway in the new session (`ssh <session>@gateway true`), over a number
//! of sessions, on a site of the real binaries (manager, agent with a simulated GPU, gateway)
//! brought up by the end-to-end harness, with a GPU free and the dev image present.
//!
//! ```text
//! cargo build --release --workspace --bins
//! cargo run --release -p ongrid-e2e --example time_to_shell -- [SESSIONS]
//! ```
//!
//! Each round creates a session, waits for it, logs in once and runs `true`, then removes it
//! and waits for its container to be gone.
//! A first round, not counted, gives the user a home volume (made once per user). Prints every
//! round, then p50 and p99 (nearest rank) of the whole and of its two parts: `devctl session
//! new --wait` (request → container running and reported) and the SSH login with the command;
//! the first two also to `bench/run.sh`'s table ([`bench_summary`]).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use ongrid_e2e::{bench_summary, docker_lines, SimGpu, Site};

const DEFAULT_SESSIONS: usize = 20;

fn main() -> ExitCode {
    let sessions = match std::env::args().nth(1).map(|a| a.parse::<usize>()) {
        None => DEFAULT_SESSIONS,
        Some(Ok(n)) if n > 0 => n,
        Some(_) => {
            eprintln!("usage: time_to_shell [SESSIONS]  (a whole number of sessions, like 20)");
            return ExitCode::from(2);
        }
    };
    let mut site = Site::start(&[SimGpu::a100(1)]);
    let user = site.user("Bench");
    site.allow_loopback();
    site.add_key(&user);

    // The user's home volume is made on their first session: not what a returning user waits.
    round(&site, &user, "warmup");
    let mut total = Vec::new();
    let mut waits = Vec::new();
    let mut logins = Vec::new();
    println!("round  new --wait  ssh true  total");
    for i in 1..=sessions {
        let (wait, login) = round(&site, &user, &format!("bench{i}"));
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
fn round(site: &Site, user: &ongrid_e2e::User, name: &str) -> (Duration, Duration) {
    let start = Instant::now();
    site.devctl_ok(user, &["session", "new", "--name", name, "--wait"]);
    let running = start.elapsed();
    let out = site.ssh(user, name, "true", b"");
    let login = start.elapsed() - running;
    assert!(
        out.status.success(),
        "ssh {name}@gateway true failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        site.logs()
    );
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

/// The nearest-rank percentile of sorted samples.
fn percentile(sorted: &[Duration], p: usize) -> Duration {
    let rank = (p * sorted.len()).div_ceil(100).max(1);
    sorted[rank - 1]
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}
