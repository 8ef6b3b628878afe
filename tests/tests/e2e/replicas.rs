//! Two manager replicas on one PostgreSQL database, and the real clients given both URLs: the
//! agent, the gateway and devctl. The replica they all talk to, which also leads, is killed with
//! SIGKILL; each goes on through the other within seconds, and no session is lost or started
//! twice.

use std::time::{Duration, Instant};

use ongrid_e2e::{docker_lines, SimGpu, Site};
use serde_json::Value;

/// The longest the clients may take to go on through the other replica once the first is
/// killed: the follower leads 3 s after the leader's death (`TAKEOVER_GRACE`), then places.
const WITHIN: Duration = Duration::from_secs(15);

/// How often the session went to STARTING (was placed).
fn placements(view: &Value) -> usize {
    view["transitions"]
        .as_array()
        .map(|transitions| transitions.iter().filter(|t| t["to"] == "STARTING").count())
        .unwrap_or(0)
}

/// The ids of every container, running or not, of session `id`.
fn containers_of(id: &str) -> Vec<String> {
    docker_lines(&[
        "ps",
        "-a",
        "--filter",
        &format!("label=ongrid.session={id}"),
        "--format",
        "{{.ID}}",
    ])
}

#[test]
fn killing_the_replica_everyone_talks_to_cuts_nobody_off() {
    let mut site = Site::start_replicated(&[
        SimGpu::a100(1),
        SimGpu::a100(2),
        SimGpu::a100(3),
        SimGpu::a100(4),
    ]);
    // The second replica waits for the first's manager lock: the first leads.
    site.wait_until(
        "the second replica to follow",
        Duration::from_secs(30),
        || {
            std::fs::read_to_string(site.dir.path().join("manager2.log"))
                .ok()?
                .contains("Follower")
                .then_some(())
        },
    );
    site.allow_loopback();
    let alice = site.user("Alice");
    site.add_key(&alice);
    let mut before = Vec::new();
    for name in ["one", "two"] {
        site.devctl_ok(&alice, &["session", "new", "--name", name, "--wait"]);
        let view = site.wait_for_state(&alice, name, "WAITING");
        let id = view["id"].as_str().expect("session id").to_owned();
        let containers = containers_of(&id);
        assert_eq!(containers.len(), 1, "{name}: {containers:?}");
        before.push((name, id, containers));
    }
    // Each client has talked to the first replica only (it answered every call).
    let dir = site.dir.path().to_owned();
    let gateway_log = || std::fs::read_to_string(dir.join("gateway.log")).unwrap();
    let agent_log = || std::fs::read_to_string(dir.join("agent.log")).unwrap();
    let moved_on = "Going on with the next manager of manager_url";
    assert!(!agent_log().contains(moved_on));
    assert!(!gateway_log().contains(moved_on));

    site.kill_manager();
    let killed = Instant::now();

    // devctl lists and creates through the second replica.
    let listed = site.devctl_ok(&alice, &["session", "ls"]);
    assert!(listed.contains("one") && listed.contains("two"), "{listed}");
    let listed_after = killed.elapsed();
    site.devctl_ok(&alice, &["session", "new", "--name", "three", "--wait"]);
    // The agent, now reporting to the second replica, started it.
    let three = site.wait_for_state(&alice, "three", "WAITING");
    let started_after = killed.elapsed();
    // The gateway routes a login through the second replica.
    let login = site.wait_until("ssh through the gateway", WITHIN, || {
        let out = site.ssh(&alice, "one", "echo still-here", b"");
        out.status.success().then_some(out)
    });
    let ssh_after = killed.elapsed();
    assert_eq!(String::from_utf8_lossy(&login.stdout), "still-here\n");
    println!(
        "after the SIGKILL of the leader: devctl listed at {listed_after:?}, a new session \
         WAITING at {started_after:?}, ssh through the gateway at {ssh_after:?}"
    );
    assert!(
        ssh_after < WITHIN,
        "the clients took {ssh_after:?} to go on\n{}",
        site.logs()
    );
    assert!(agent_log().contains(moved_on), "{}", site.logs());
    assert!(gateway_log().contains(moved_on), "{}", site.logs());

    // Nothing lost, nothing placed or started twice: the same container for each session.
    for (name, id, containers) in &before {
        let view: Value = site
            .devctl_json(&alice, &["session", "show", name])
            .expect("session show");
        assert_ne!(view["state"], "ENDED", "{view}");
        assert_ne!(view["state"], "FAILED", "{view}");
        assert_eq!(placements(&view), 1, "{view}");
        assert_eq!(&containers_of(id), containers, "{name}: never recreated");
    }
    assert_eq!(placements(&three), 1, "{three}");
    let three_id = three["id"].as_str().expect("session id");
    assert_eq!(containers_of(three_id).len(), 1);
}
