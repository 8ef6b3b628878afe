//! Restarts of the Docker daemon under a running session, with and without Docker's
//! live-restore, on a daemon each test starts itself ([`TestDockerd`]: its own socket, data
//! root, containerd and network namespace). The machine's daemon and its containers are never
//! touched, so these tests run beside every other.
//!
//! Without live-restore the daemon stops every container when it stops, and ongrid never
//! restarts a container behind the user's back (ARCHITECTURE.md, "Session states and
//! containers"): the session is FAILED within 60 s of the restart with a reason that names the
//! Docker daemon and live-restore, its container is kept for inspection (one, not recreated),
//! and the agent, which reconnects to the new daemon, starts new sessions again. With
//! live-restore the session stays WAITING in the same container, never restarted, and an SSH
//! connection open across the restart goes on working (its process was started by runc beside
//! dockerd, not through it).

use std::io::{BufRead, BufReader, Read, Write};
use std::process::Stdio;
use std::time::Duration;

use ongrid_e2e::dockerd::{LiveRestore, TestDockerd};
use ongrid_e2e::{SimGpu, Site};
use serde_json::Value;

use crate::{converges_to, explain, show, ssh_works, states, CONVERGE};

/// How long after the restart the session may take to be FAILED, or a new one WAITING.
const AFTER_RESTART: Duration = Duration::from_secs(60);

/// The ids of the containers, in any state, of session `view` on `dockerd`.
fn containers_of(dockerd: &TestDockerd, view: &Value) -> Vec<String> {
    let id = view["id"].as_str().expect("session id");
    dockerd.docker_lines(&[
        "ps",
        "-aq",
        "--no-trunc",
        "--filter",
        &format!("label=ongrid.session={id}"),
    ])
}

/// The full id of the one container of session `view` on `dockerd`.
fn one_container(site: &Site, dockerd: &TestDockerd, view: &Value) -> String {
    let containers = containers_of(dockerd, view);
    assert_eq!(
        containers.len(),
        1,
        "session {} must have exactly one container: {containers:?}\n{}{}",
        view["id"],
        site.logs(),
        dockerd.log_tail()
    );
    containers[0].clone()
}

/// `State` of the container named in `view`, from `dockerd`.
fn container_state(dockerd: &TestDockerd, view: &Value) -> Value {
    let name = view["container"].as_str().expect("container name");
    dockerd
        .inspect_container(name)
        .unwrap_or_else(|| panic!("container {name} exists"))["State"]
        .clone()
}

/// The agent's log so far.
fn agent_log(site: &Site) -> String {
    std::fs::read_to_string(site.dir.path().join("agent.log")).expect("read the agent's log")
}

/// Without live-restore, the restart stops the session's container: the session is FAILED
/// within 60 s saying that the Docker daemon stopped it and what live-restore would have done,
/// its one container kept and not restarted; a new session is WAITING within 60 s.
#[test]
fn without_live_restore_a_docker_restart_fails_the_session_saying_why() {
    let mut dockerd = TestDockerd::start(LiveRestore::Off);
    let mut site = Site::start_on(&[SimGpu::a100(1), SimGpu::a100(2)], &dockerd);
    let log = agent_log(&site);
    assert!(
        log.contains("Docker's live-restore is off") && log.contains("/etc/docker/daemon.json"),
        "the agent says at start-up that live-restore is off and how to turn it on\n{log}"
    );
    let alice = site.user("Alice");
    site.devctl_ok(&alice, &["session", "new", "--name", "train1", "--wait"]);
    let before = show(&site, &alice, "train1");
    let container = one_container(&site, &dockerd, &before);
    assert_eq!(container_state(&dockerd, &before)["Running"], true);

    dockerd.restart();

    let failed = converges_to(&site, &alice, "train1", "FAILED", AFTER_RESTART);
    let reason = failed["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("when the node's Docker daemon stopped or restarted")
            && reason.contains("live-restore"),
        "{reason}\n{failed:#}"
    );
    assert_eq!(
        one_container(&site, &dockerd, &failed),
        container,
        "kept, not recreated"
    );
    assert_eq!(
        container_state(&dockerd, &failed)["Running"],
        false,
        "never restarted behind the user's back"
    );

    site.devctl_ok(&alice, &["session", "new", "--name", "after"]);
    let after = converges_to(&site, &alice, "after", "WAITING", AFTER_RESTART);
    assert_eq!(container_state(&dockerd, &after)["Running"], true);
    one_container(&site, &dockerd, &after);
}

/// With live-restore, the restart leaves the session's container running: the session stays
/// WAITING (no other state entered) in the same container, started once; an SSH connection
/// open across the restart still echoes; new commands and a new session work after it.
#[test]
fn with_live_restore_a_session_keeps_running_across_a_docker_restart() {
    let mut dockerd = TestDockerd::start(LiveRestore::On);
    let mut site = Site::start_on(&[SimGpu::a100(1), SimGpu::a100(2)], &dockerd);
    let log = agent_log(&site);
    assert!(
        log.contains("Docker's live-restore is on"),
        "the agent says at start-up that live-restore is on\n{log}"
    );
    site.allow_loopback();
    let alice = site.user("Alice");
    site.add_key(&alice);
    site.devctl_ok(&alice, &["session", "new", "--name", "train1", "--wait"]);
    let before = show(&site, &alice, "train1");
    let container = one_container(&site, &dockerd, &before);
    let started = container_state(&dockerd, &before)["StartedAt"].clone();
    ssh_works(&site, &alice, "train1", "true", CONVERGE);

    // A connection open across the restart: `cat` echoes a line before and one after.
    let mut open = site
        .ssh_command(&alice, "train1")
        .arg("cat")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run ssh");
    let mut input = open.stdin.take().expect("ssh stdin");
    let mut output = BufReader::new(open.stdout.take().expect("ssh stdout"));
    input.write_all(b"before\n").expect("write to ssh");
    let mut line = String::new();
    output.read_line(&mut line).expect("read from ssh");
    assert_eq!(line, "before\n");
    converges_to(&site, &alice, "train1", "CONNECTED", CONVERGE);

    dockerd.restart();

    input
        .write_all(b"after\n")
        .expect("write to ssh after the restart");
    drop(input);
    let mut rest = String::new();
    output
        .read_to_string(&mut rest)
        .expect("read from ssh after the restart");
    let status = open.wait().expect("wait for ssh");
    let mut stderr = String::new();
    let _ = open
        .stderr
        .take()
        .expect("ssh stderr")
        .read_to_string(&mut stderr);
    assert!(
        status.success() && rest == "after\n",
        "the connection open across the restart: {status}, {rest:?}, {stderr}\n{}{}",
        site.logs(),
        dockerd.log_tail()
    );

    // A new command, through the agent on the restarted daemon.
    let out = ssh_works(&site, &alice, "train1", "echo still here", CONVERGE);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "still here\n",
        "{}",
        explain(&out)
    );
    // A new session: the agent creates containers on the restarted daemon.
    site.devctl_ok(&alice, &["session", "new", "--name", "after"]);
    let after = converges_to(&site, &alice, "after", "WAITING", AFTER_RESTART);
    assert_eq!(container_state(&dockerd, &after)["Running"], true);

    let now = show(&site, &alice, "train1");
    assert!(
        ["CONNECTED", "IDLE", "WAITING"].contains(&now["state"].as_str().unwrap_or_default()),
        "{now:#}"
    );
    assert!(
        !states(&now).iter().any(|s| s == "FAILED" || s == "HELD"),
        "never FAILED nor HELD: {now:#}"
    );
    assert_eq!(
        one_container(&site, &dockerd, &now),
        container,
        "the same container"
    );
    let state = container_state(&dockerd, &now);
    assert_eq!(state["Running"], true, "{state:#}");
    assert_eq!(state["StartedAt"], started, "never restarted: {state:#}");
}
