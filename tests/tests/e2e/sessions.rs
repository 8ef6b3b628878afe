//! Sessions on GPUs: create, inspect the dev container, delete, restarts, queueing, isolation.

use std::time::Duration;

use ongrid_e2e::{docker_exec, docker_lines, inspect_container, SimGpu, Site};
use serde_json::Value;

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn session_runs_in_a_hardened_container_and_is_removed() {
    let mut site = Site::start(&[SimGpu::a100(1), SimGpu::h100(2)]);
    let alice = site.user("Alice");
    let login = site.login_of("Alice");

    site.devctl_ok(
        &alice,
        &[
            "session",
            "new",
            "--name",
            "train1",
            "--min-capability",
            "9.0",
            "--wait",
        ],
    );
    let view = site.wait_for_state(&alice, "train1", "WAITING");
    // The least capable GPU meeting 9.0 is the H100.
    assert_eq!(strings(&view["gpus"]), vec![SimGpu::h100(2).uuid]);
    assert_eq!(view["node"], site.node.as_str());
    let container = view["container"]
        .as_str()
        .expect("container name")
        .to_owned();
    let id = view["id"].as_str().expect("session id").to_owned();

    let c = inspect_container(&container).expect("the dev container exists");
    assert_eq!(c["State"]["Running"], true);
    let labels = &c["Config"]["Labels"];
    assert_eq!(labels["ongrid.managed"], "true");
    assert_eq!(labels["ongrid.session"], id.as_str());
    assert_eq!(labels["ongrid.session.name"], "train1");
    assert_eq!(labels["ongrid.user"], login.as_str());
    assert_eq!(labels["ongrid.owner"], alice.creds.dn.as_str());

    let env = strings(&c["Config"]["Env"]);
    let gpu = SimGpu::h100(2).uuid;
    assert!(
        env.contains(&format!("CUDA_VISIBLE_DEVICES={gpu}")),
        "{env:?}"
    );
    assert!(
        env.contains(&format!("NVIDIA_VISIBLE_DEVICES={gpu}")),
        "{env:?}"
    );

    let host = &c["HostConfig"];
    assert_eq!(host["NanoCpus"], 1_500_000_000u64);
    assert_eq!(host["Memory"], 1u64 << 30);
    assert_eq!(host["PidsLimit"], 512);
    assert_eq!(strings(&host["CapDrop"]), vec!["ALL".to_owned()]);
    assert!(strings(&host["CapAdd"]).is_empty(), "{:?}", host["CapAdd"]);
    assert!(strings(&host["SecurityOpt"])
        .iter()
        .any(|o| o.starts_with("no-new-privileges")));
    assert_ne!(host["Privileged"], true);
    // No GPU device request: the simulated backend has no real GPUs.
    assert!(host["DeviceRequests"].as_array().is_none_or(Vec::is_empty));
    let mounts = c["Mounts"].as_array().expect("mounts");
    assert!(
        mounts
            .iter()
            .all(|m| !m["Source"].as_str().unwrap_or("").contains("docker.sock")),
        "the Docker socket must never be mounted: {mounts:?}"
    );
    let home = format!("/home/{login}");
    assert!(
        mounts
            .iter()
            .any(|m| m["Type"] == "volume" && m["Destination"] == home.as_str()),
        "home volume at {home}: {mounts:?}"
    );

    // Inside: the user's own name and UID, no capabilities, a writable home.
    let (code, who) = docker_exec(&container, &["id", "-un"]);
    assert_eq!((code, who.trim()), (0, login.as_str()));
    let (_, uid) = docker_exec(&container, &["id", "-u"]);
    let uid: u32 = uid.trim().parse().expect("numeric uid");
    assert!(uid >= 20000, "uid {uid}");
    let (_, status) = docker_exec(
        &container,
        &["grep", "-E", "^(CapEff|NoNewPrivs)", "/proc/self/status"],
    );
    assert!(status.contains("CapEff:\t0000000000000000"), "{status}");
    assert!(status.contains("NoNewPrivs:\t1"), "{status}");
    let (code, _) = docker_exec(
        &container,
        &[
            "sh",
            "-c",
            &format!("echo hi > {home}/hello && cat {home}/hello"),
        ],
    );
    assert_eq!(code, 0, "home must be writable");
    let (code, _) = docker_exec(&container, &["touch", "/etc/passwd"]);
    assert_ne!(code, 0, "the user must not be root");

    // Remove: the session ends and the container goes away; the home volume stays.
    site.devctl_ok(&alice, &["session", "rm", "train1"]);
    site.wait_until(
        "the container to be removed",
        Duration::from_secs(30),
        || inspect_container(&container).is_none().then_some(()),
    );
    let listed: Vec<Value> = site
        .devctl_json(&alice, &["session", "ls"])
        .expect("session ls");
    assert!(
        listed
            .iter()
            .all(|s| s["name"] != "train1" || s["state"] == "ENDED"),
        "{listed:?}"
    );
    let volumes = docker_lines(&[
        "volume",
        "ls",
        "-q",
        "--filter",
        &format!("name=ongrid-home-{login}"),
    ]);
    assert_eq!(volumes, vec![format!("ongrid-home-{login}")]);
}

#[test]
fn restarts_of_manager_and_agent_lose_nothing_and_duplicate_nothing() {
    let mut site = Site::start(&[SimGpu::a100(1), SimGpu::a100(2)]);
    let bob = site.user("Bob");
    site.devctl_ok(&bob, &["session", "new", "--name", "first", "--wait"]);
    let first = site.wait_for_state(&bob, "first", "WAITING");
    let container = first["container"].as_str().expect("container").to_owned();
    let container_id = inspect_container(&container).expect("container")["Id"].clone();

    // The agent goes away; a second session is created meanwhile; then the manager restarts.
    site.stop_agent();
    site.devctl_ok(&bob, &["session", "new", "--name", "second"]);
    site.stop_manager();
    site.start_manager();

    let after: Value = site
        .devctl_json(&bob, &["session", "show", "first"])
        .expect("show first");
    assert_eq!(after["state"], "WAITING");
    assert_eq!(after["gpus"], first["gpus"]);
    assert_eq!(
        after["transitions"], first["transitions"],
        "history must survive a restart"
    );
    let second: Value = site
        .devctl_json(&bob, &["session", "show", "second"])
        .expect("show second");
    assert!(
        matches!(second["state"].as_str(), Some("PENDING" | "STARTING")),
        "{second}"
    );

    site.start_agent();
    let second = site.wait_for_state(&bob, "second", "WAITING");
    assert_ne!(
        second["gpus"], first["gpus"],
        "the two sessions must not share a GPU"
    );

    // The first container was adopted, not recreated; each session has exactly one container.
    let now = inspect_container(&container).expect("first container still exists");
    assert_eq!(now["Id"], container_id);
    assert_eq!(now["State"]["Running"], true);
    for view in [&first, &second] {
        let id = view["id"].as_str().expect("id");
        let containers = docker_lines(&[
            "ps",
            "-aq",
            "--filter",
            &format!("label=ongrid.session={id}"),
        ]);
        assert_eq!(containers.len(), 1, "session {id}: {containers:?}");
    }

    // A second agent restart also adopts.
    site.stop_agent();
    site.start_agent();
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        inspect_container(&container).expect("still there")["Id"],
        container_id
    );
}

#[test]
fn impossible_requests_are_refused_with_the_requirement_named() {
    let mut site = Site::start(&[SimGpu::a100(1), SimGpu::a100(2)]);
    let carol = site.user("Carol");

    let out = site.devctl(&carol, &["session", "new", "--gpus", "3"]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("3 GPUs") && err.contains('2'), "{err}");

    let out = site.devctl(&carol, &["session", "new", "--min-capability", "9.5"]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("9.5") && err.contains("8.0"), "{err}");

    let out = site.devctl(&carol, &["session", "new", "--min-gpu-memory", "80G"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("memory"), "{}", stderr(&out));

    let out = site.devctl(&carol, &["session", "new", "--share", "shared"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("shared"), "{}", stderr(&out));

    // Nothing was stored by the refused requests.
    let listed: Vec<Value> = site.devctl_json(&carol, &["session", "ls"]).expect("ls");
    assert!(listed.is_empty(), "{listed:?}");
}

#[test]
fn a_full_site_queues_and_starts_the_session_when_a_gpu_frees() {
    let mut site = Site::start(&[SimGpu::a100(1), SimGpu::a100(2)]);
    let dave = site.user("Dave");
    site.devctl_ok(&dave, &["session", "new", "--name", "one", "--wait"]);
    site.devctl_ok(&dave, &["session", "new", "--name", "two", "--wait"]);

    let out = site.devctl(&dave, &["session", "new", "--name", "three"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("queued at position 1"),
        "{}",
        stderr(&out)
    );
    let three: Value = site
        .devctl_json(&dave, &["session", "show", "three"])
        .expect("show");
    assert_eq!(three["state"], "PENDING");
    assert_eq!(three["queue_position"], 1);
    // It stays pending while the site is full.
    std::thread::sleep(Duration::from_secs(3));
    let three: Value = site
        .devctl_json(&dave, &["session", "show", "three"])
        .expect("show");
    assert_eq!(three["state"], "PENDING");

    let one: Value = site
        .devctl_json(&dave, &["session", "show", "one"])
        .expect("show");
    site.devctl_ok(&dave, &["session", "rm", "one"]);
    let three = site.wait_for_state(&dave, "three", "WAITING");
    assert_eq!(
        three["gpus"], one["gpus"],
        "three takes the GPU that one freed"
    );
    let reasons: Vec<String> = three["transitions"]
        .as_array()
        .expect("transitions")
        .iter()
        .map(|t| t["to"].as_str().unwrap_or("").to_owned())
        .collect();
    assert_eq!(reasons, ["PENDING", "STARTING", "WAITING"]);
}

#[test]
fn users_neither_see_nor_remove_each_others_sessions() {
    let mut site = Site::start(&[SimGpu::a100(1), SimGpu::a100(2)]);
    let erin = site.user("Erin");
    let frank = site.user("Frank");
    site.devctl_ok(&erin, &["session", "new", "--name", "mine", "--wait"]);
    site.devctl_ok(&frank, &["session", "new", "--name", "franks", "--wait"]);

    let erins: Vec<Value> = site.devctl_json(&erin, &["session", "ls"]).expect("ls");
    assert_eq!(erins.len(), 1);
    assert_eq!(erins[0]["name"], "mine");

    for args in [["session", "show", "franks"], ["session", "rm", "franks"]] {
        let out = site.devctl(&erin, &args);
        assert!(!out.status.success(), "erin ran {args:?}");
        assert!(stderr(&out).contains("no session"), "{}", stderr(&out));
    }
    let franks = site.wait_for_state(&frank, "franks", "WAITING");
    assert!(inspect_container(franks["container"].as_str().expect("container")).is_some());

    // Both may use the same name.
    site.devctl_ok(&frank, &["session", "new", "--name", "mine"]);

    // The admin sees everyone's sessions and may remove any.
    let all: Vec<Value> = site
        .devctl_json(&site.admin, &["session", "ls", "--all"])
        .expect("ls --all");
    assert_eq!(all.len(), 3, "{all:?}");
    site.devctl_ok(
        &site.admin,
        &["session", "rm", "franks", "--owner", &frank.creds.dn],
    );
    let gone: Value = site
        .devctl_json(&frank, &["session", "show", "franks"])
        .unwrap_or(Value::Null);
    assert!(gone.is_null() || gone["state"] == "ENDED", "{gone}");
}

#[test]
fn a_container_that_dies_fails_its_session_with_the_reason() {
    let mut site = Site::start(&[SimGpu::a100(1)]);
    let gina = site.user("Gina");
    site.devctl_ok(&gina, &["session", "new", "--name", "doomed", "--wait"]);
    let view = site.wait_for_state(&gina, "doomed", "WAITING");
    let container = view["container"].as_str().expect("container").to_owned();

    let killed = std::process::Command::new("docker")
        .args(["kill", &container])
        .output()
        .expect("docker kill");
    assert!(killed.status.success(), "{}", stderr(&killed));

    let failed = site.wait_for_state(&gina, "doomed", "FAILED");
    let reason = failed["reason"].as_str().expect("reason");
    assert!(
        reason.contains("137") || reason.contains("SIGKILL"),
        "{reason}"
    );
    // The agent reports the death and does not restart the container behind the user's back.
    let c = inspect_container(&container).expect("the dead container is kept for inspection");
    assert_eq!(c["State"]["Running"], false);

    // Its GPU is free again: a new session starts on it.
    site.devctl_ok(&gina, &["session", "new", "--name", "again", "--wait"]);
    let again = site.wait_for_state(&gina, "again", "WAITING");
    assert_eq!(again["gpus"], view["gpus"]);

    // Removing the failed session removes its container.
    site.devctl_ok(&gina, &["session", "rm", "doomed"]);
    site.wait_until(
        "the dead container to be removed",
        Duration::from_secs(30),
        || inspect_container(&container).is_none().then_some(()),
    );
}
