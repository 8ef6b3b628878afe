//! SIGKILL of the manager, the agent and the gateway during session start, while a session
//! runs (with an SSH connection open) and during release.

use std::process::Stdio;
use std::time::Duration;

use ongrid_e2e::{docker_exec, docker_lines, inspect_container, SimGpu, Site};
use serde_json::Value;

use crate::{
    catch, containers_of, converges_to, explain, one_container, running, show, ssh_works, states,
    CONVERGE,
};

/// Start interrupted in the manager: `session new` is answered (the session is PENDING or
/// already STARTING) and the manager is killed at once. Back, the session is WAITING within 30 s,
/// with one container and each state entered once.
#[test]
fn manager_killed_right_after_session_new_the_session_is_waiting_within_30s() {
    let mut site = Site::start(&[SimGpu::a100(1)]);
    let alice = site.user("Alice");
    site.devctl_ok(&alice, &["session", "new", "--name", "train1"]);
    site.kill_manager();
    site.start_manager();

    let view = converges_to(&site, &alice, "train1", "WAITING", CONVERGE);
    assert!(running(&view), "{view:#}");
    one_container(&site, &view);
    assert_eq!(
        states(&view),
        ["PENDING", "STARTING", "WAITING"],
        "{view:#}"
    );
    let listed: Vec<Value> = site
        .devctl_json(&alice, &["session", "ls"])
        .expect("session ls");
    assert_eq!(listed.len(), 1, "one session, not two: {listed:?}");
}

/// Start interrupted in the agent, twice: killed as soon as the session's network appears in
/// Docker (before the container), and as soon as its container appears (created, being set up
/// and started). Back, the agent adopts or recreates it: WAITING within 30 s, one container, one
/// network, each state entered once.
#[test]
fn agent_killed_while_the_container_is_created_the_session_is_waiting_within_30s() {
    let mut site = Site::start(&[SimGpu::a100(1), SimGpu::a100(2)]);
    let alice = site.user("Alice");
    for (name, at_container) in [("train1", false), ("train2", true)] {
        site.devctl_ok(&alice, &["session", "new", "--name", name]);
        let id = show(&site, &alice, name)["id"]
            .as_str()
            .expect("session id")
            .to_owned();
        let network = format!("ongrid-net-{}", id.replace('-', ""));
        let networks = || {
            docker_lines(&[
                "network",
                "ls",
                "-q",
                "--filter",
                &format!("name={network}"),
            ])
        };
        let what = if at_container { "container" } else { "network" };
        catch(
            &site,
            &format!("Docker to have the session's {what}"),
            CONVERGE,
            || {
                let seen = if at_container {
                    !containers_of(&id).is_empty()
                } else {
                    !networks().is_empty()
                };
                seen.then_some(())
            },
        );
        site.kill_agent();
        let seen_at_kill = containers_of(&id);
        let state_at_kill = seen_at_kill
            .first()
            .and_then(|c| inspect_container(c))
            .map(|c| c["State"]["Status"].as_str().unwrap_or("").to_owned());
        site.start_agent();

        let view = converges_to(&site, &alice, name, "WAITING", CONVERGE);
        assert!(running(&view), "{view:#}");
        // A container that was already running is adopted; one created but never started is
        // removed and created again (it has nothing of the user's yet). Either way one is left.
        let container = one_container(&site, &view);
        assert!(
            seen_at_kill.len() <= 1,
            "never two containers, even half-way: {seen_at_kill:?}"
        );
        eprintln!(
            "{name}: agent killed once the {what} existed (container {seen_at_kill:?}, \
             {state_at_kill:?}); converged to {container} ({})",
            if seen_at_kill.contains(&container) {
                "adopted"
            } else {
                "created after the kill"
            }
        );
        assert_eq!(networks().len(), 1, "one network");
        assert_eq!(
            states(&view),
            ["PENDING", "STARTING", "WAITING"],
            "{view:#}"
        );
    }
}

/// A running session with an SSH connection open; the gateway, the agent and the manager are
/// each killed. The ssh client is disconnected; back, the same container runs (adopted, never
/// recreated) and ssh works within 30 s. The connection the dead gateway never closed stops
/// counting after `connection_stale_after` (20 s), so it does not keep the session alive: with
/// `idle_timeout` 10 s the session is HELD as idle within 60 s.
#[test]
fn every_component_killed_while_a_session_runs_the_same_container_serves_ssh_within_30s() {
    let mut site = Site::start_with_lifecycle(
        &[SimGpu::a100(1)],
        "connection_stale_after = \"20s\"\nconnect_deadline = \"1 hour\"\nidle_timeout = \"10s\"\n\
         startup_grace = \"1s\"",
    );
    site.allow_loopback();
    let alice = site.user("Alice");
    site.add_key(&alice);
    site.devctl_ok(&alice, &["session", "new", "--name", "train1", "--wait"]);
    let before = show(&site, &alice, "train1");
    let container = one_container(&site, &before);
    ssh_works(&site, &alice, "train1", "true", CONVERGE);

    // A long connection, open when the gateway dies.
    let mut long = site
        .ssh_command(&alice, "train1")
        .arg("echo open; exec sleep 600")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run ssh");
    let stdout = long.stdout.take().expect("stdout");
    let mut first = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut first)
        .expect("read from ssh");
    assert_eq!(first, "open\n");
    converges_to(&site, &alice, "train1", "CONNECTED", CONVERGE);

    site.kill_gateway();
    let status = site.wait_until("the ssh client to be disconnected", CONVERGE, || {
        long.try_wait().expect("wait for ssh")
    });
    assert!(!status.success(), "ssh ended with {status}");
    site.kill_agent();
    site.kill_manager();
    site.start_manager();
    site.start_agent();
    site.start_gateway();

    let out = ssh_works(&site, &alice, "train1", "id -un", CONVERGE);
    assert_eq!(
        out.stdout,
        format!("{}\n", site.login_of("Alice")).as_bytes(),
        "{}",
        explain(&out)
    );
    let after = show(&site, &alice, "train1");
    assert_eq!(
        one_container(&site, &after),
        container,
        "the same container, adopted"
    );
    assert!(running(&after));
    assert!(!states(&after).iter().any(|s| s == "FAILED"), "{after:#}");

    let held = converges_to(&site, &alice, "train1", "HELD", Duration::from_secs(60));
    let reason = held["reason"].as_str().unwrap_or_default();
    assert!(reason.starts_with("idle:"), "{reason}");
    assert_eq!(
        states(&held).iter().filter(|s| *s == "WAITING").count(),
        1,
        "started once: {held:#}"
    );
    assert!(!states(&held).iter().any(|s| s == "FAILED"), "{held:#}");
    assert_eq!(one_container(&site, &held), container);
}

/// Release interrupted: the session is held (container stopped), released, and at once the agent
/// is killed; later, held and released again, the manager is killed. Each time the session is
/// WAITING within 30 s in the same container, with the user's files.
#[test]
fn agent_or_manager_killed_during_release_the_same_container_runs_within_30s() {
    let mut site = Site::start(&[SimGpu::a100(1)]);
    site.allow_loopback();
    let alice = site.user("Alice");
    site.add_key(&alice);
    site.devctl_ok(&alice, &["session", "new", "--name", "train1", "--wait"]);
    let view = show(&site, &alice, "train1");
    let container = one_container(&site, &view);
    let name = view["container"].as_str().expect("container").to_owned();
    let (code, _) = docker_exec(&name, &["sh", "-c", "echo kept > /tmp/ongrid-marker"]);
    assert_eq!(code, 0);

    for victim in ["agent", "manager"] {
        site.devctl_ok(&alice, &["session", "hold", "train1"]);
        converges_to(&site, &alice, "train1", "HELD", CONVERGE);
        site.wait_until("the held container to stop", CONVERGE, || {
            (!running(&view)).then_some(())
        });
        site.devctl_ok(&alice, &["session", "release", "train1"]);
        match victim {
            "agent" => {
                site.kill_agent();
                site.start_agent();
            }
            _ => {
                site.kill_manager();
                site.start_manager();
            }
        }
        let back = converges_to(&site, &alice, "train1", "WAITING", CONVERGE);
        assert_eq!(
            one_container(&site, &back),
            container,
            "{victim} killed during release: the same container"
        );
        assert!(running(&back));
        let (code, marker) = docker_exec(&name, &["cat", "/tmp/ongrid-marker"]);
        assert_eq!((code, marker.trim()), (0, "kept"), "{}", site.logs());
    }
    let out = ssh_works(&site, &alice, "train1", "cat /tmp/ongrid-marker", CONVERGE);
    assert_eq!(out.stdout, b"kept\n");
    let history = show(&site, &alice, "train1");
    let count = |state: &str| states(&history).iter().filter(|s| *s == state).count();
    assert_eq!(
        (count("WAITING"), count("HELD"), count("FAILED")),
        (3, 2, 0),
        "started once and resumed twice, never failed: {history:#}"
    );
}
