//! Node and GPU operations end to end: drains with running work left alone, a node whose agent
//! stops syncing (its session FAILED with the reason; its container stopped, never doubled, when
//! the agent is back), and `devctl admin node ls` as an admin sees it.

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::Duration;

use ongrid_e2e::{inspect_container, SimGpu, Site};
use serde_json::Value;

fn running(container: &str) -> bool {
    inspect_container(container).is_some_and(|c| c["State"]["Running"] == true)
}

#[test]
fn drained_gpus_and_nodes_get_nothing_new_and_running_sessions_keep_running() {
    let mut site = Site::start(&[SimGpu::a100(1), SimGpu::a100(2)]);
    let alice = site.user("Alice");
    let admin = site.admin.clone();
    let node = site.node.clone();
    let gpu1 = SimGpu::a100(1).uuid;
    let gpu2 = SimGpu::a100(2).uuid;

    site.devctl_ok(&alice, &["session", "new", "--name", "first", "--wait"]);
    let first = site.wait_for_state(&alice, "first", "WAITING");
    assert_eq!(first["gpus"][0], gpu1.as_str());
    let first_container = first["container"].as_str().expect("container").to_owned();

    // Drain the GPU in use: the session on it keeps running; the next one gets the other GPU.
    let out = site.devctl_ok(
        &admin,
        &["admin", "gpu", "drain", &gpu1, "--reason", "fan noise"],
    );
    assert!(
        out.contains(&format!("GPU {gpu1} on {node} drained ")) && out.contains("fan noise"),
        "{out}"
    );
    site.devctl_ok(&alice, &["session", "new", "--name", "second", "--wait"]);
    let second = site.wait_for_state(&alice, "second", "WAITING");
    assert_eq!(second["gpus"][0], gpu2.as_str());
    assert!(
        running(&first_container),
        "the drained GPU's session keeps running"
    );

    // Drain the node: a third session waits in the queue; the two keep running.
    let out = site.devctl_ok(
        &admin,
        &["admin", "node", "drain", &node, "--reason", "kernel update"],
    );
    println!("$ devctl admin node drain {node} --reason \"kernel update\"\n{out}");
    assert!(
        out.contains("kernel update; 2 sessions keep running there"),
        "{out}"
    );
    let out = site.devctl(&alice, &["session", "new", "--name", "third"]);
    println!(
        "$ devctl session new --name third\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let third: Value = site
        .devctl_json(&alice, &["session", "show", "third"])
        .expect("show third");
    assert_eq!(third["state"], "PENDING");
    let gpus = site.devctl_ok(&alice, &["gpus"]);
    println!("$ devctl gpus\n{gpus}");
    assert!(
        gpus.contains("(drained)") && gpus.contains("DRAINED: fan noise"),
        "{gpus}"
    );
    let ls = site.devctl_ok(&admin, &["admin", "node", "ls"]);
    println!("$ devctl admin node ls\n{ls}");
    assert!(ls.contains("online, drained"), "{ls}");
    assert!(ls.contains(&format!("{node}: drained ")), "{ls}");

    // Undrained, the node and the GPU take the third session once the first one's GPU frees.
    let out = site.devctl_ok(&admin, &["admin", "node", "undrain", &node]);
    assert!(out.contains("is back in service"), "{out}");
    let out = site.devctl_ok(&admin, &["admin", "gpu", "undrain", &gpu1]);
    assert!(out.contains("is back in service"), "{out}");
    site.devctl_ok(&alice, &["session", "rm", "first"]);
    let third = site.wait_for_state(&alice, "third", "WAITING");
    assert_eq!(third["gpus"][0], gpu1.as_str());
    assert!(running(third["container"].as_str().expect("container")));
    assert!(running(second["container"].as_str().expect("container")));
}

#[test]
fn a_node_that_stops_syncing_loses_its_sessions_and_never_doubles_them() {
    let mut site = Site::start(&[SimGpu::a100(1)]);
    let alice = site.user("Alice");
    site.devctl_ok(&alice, &["session", "new", "--name", "train1", "--wait"]);
    let view = site.wait_for_state(&alice, "train1", "WAITING");
    let container = view["container"].as_str().expect("container").to_owned();

    // The agent dies; its container keeps running without it. After node_timeout (10 s) the
    // session is FAILED with a reason that says what to do.
    site.kill_agent();
    let failed = site.wait_for_state(&alice, "train1", "FAILED");
    let reason = failed["reason"].as_str().unwrap_or_default().to_owned();
    assert!(reason.starts_with("node lost: the agent of "), "{reason}");
    assert!(reason.contains("devctl session rm train1"), "{reason}");
    let out = site.devctl_ok(&alice, &["session", "show", "train1"]);
    println!("$ devctl session show train1\n{out}");
    let gpus: Value = site.devctl_json(&alice, &["gpus"]).expect("gpus");
    assert_eq!(gpus[0]["online"], false);
    assert_eq!(
        gpus[0]["gpus"][0]["used"], 0,
        "the lost session's GPU is free"
    );

    // The agent comes back: the lost session's container is stopped, not started again, and
    // no second container appears for it.
    site.start_agent();
    site.wait_until(
        "the lost session's container to be stopped",
        Duration::from_secs(30),
        || (!running(&container)).then_some(()),
    );
    let same: Vec<String> = ongrid_e2e::docker_lines(&[
        "ps",
        "-a",
        "--filter",
        &format!(
            "label=ongrid.session={}",
            view["id"].as_str().unwrap_or_default()
        ),
        "--format",
        "{{.Names}}",
    ]);
    assert_eq!(same, vec![container.clone()]);
    assert_eq!(
        site.devctl_json::<Value>(&alice, &["session", "show", "train1"])
            .expect("show")["state"],
        "FAILED"
    );
    site.devctl_ok(&alice, &["session", "rm", "train1"]);
    site.wait_until(
        "the lost session's container to be removed",
        Duration::from_secs(30),
        || inspect_container(&container).is_none().then_some(()),
    );
}

/// Writes the simulated GPU file of `site` with `extra` lines added to the GPU `uuid`'s entry
/// (the agent reads it again at every sync: a fault injected by hand).
fn write_gpus(site: &Site, gpus: &[SimGpu], faulty: &str, extra: &str) {
    let mut text = String::new();
    for gpu in gpus {
        text.push_str(&format!(
            "[[gpu]]\nuuid = \"{}\"\nmodel = \"{}\"\ncapability = \"{}\"\nmemory = \"{}\"\n",
            gpu.uuid, gpu.model, gpu.capability, gpu.memory
        ));
        if gpu.uuid == faulty {
            text.push_str(extra);
            text.push('\n');
        }
        text.push('\n');
    }
    std::fs::write(site.dir.path().join("gpus.toml"), text).expect("write the simulated GPUs");
}

#[test]
fn a_gpu_that_falls_off_the_bus_fails_its_session_and_stays_drained_until_an_admin_undrains_it() {
    let gpus = [SimGpu::a100(1), SimGpu::a100(2)];
    let mut site = Site::start(&gpus);
    let alice = site.user("Alice");
    let admin = site.admin.clone();
    let gpu1 = SimGpu::a100(1).uuid;
    site.devctl_ok(&alice, &["session", "new", "--name", "train1", "--wait"]);
    let view = site.wait_for_state(&alice, "train1", "WAITING");
    assert_eq!(view["gpus"][0], gpu1.as_str());
    let container = view["container"].as_str().expect("container").to_owned();

    // Alice is connected: a command runs in the session over SSH when the GPU fails.
    site.allow_loopback();
    site.add_key(&alice);
    let connected = site.wait_until(
        "an ssh command to run in the session",
        Duration::from_secs(30),
        || {
            let mut child = site
                .ssh_command(&alice, "train1")
                .arg("echo ready; exec sleep 600")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("run ssh");
            let mut first = String::new();
            let stdout = child.stdout.take().expect("ssh stdout");
            let _ = BufReader::new(stdout).read_line(&mut first);
            if first.trim() == "ready" {
                Some(child)
            } else {
                let _ = child.wait();
                None
            }
        },
    );

    // GPU 1 falls off the bus (a fatal Xid, injected into the simulated backend).
    write_gpus(&site, &gpus, &gpu1, "xid = 79");
    let failed = site.wait_for_state(&alice, "train1", "FAILED");
    let reason = failed["reason"].as_str().unwrap_or_default().to_owned();
    assert!(
        reason.starts_with(&format!(
            "GPU {gpu1} is out of service (failed: Xid 79 (simulated): GPU has fallen off the bus)"
        )),
        "{reason}"
    );
    // The container is stopped under the connected user, who is told why.
    let out = connected.wait_with_output().expect("wait for ssh");
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("$ ssh train1@gateway 'echo ready; exec sleep 600'  (stderr)\n{stderr}");
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("ongrid: session train1 FAILED: {reason}")),
        "the connected user must be told why the session ended: {stderr}"
    );
    let out = site.devctl_ok(&alice, &["session", "show", "train1"]);
    println!("$ devctl session show train1\n{out}");
    site.wait_until(
        "the failed session's container to be stopped",
        Duration::from_secs(30),
        || (!running(&container)).then_some(()),
    );
    let out = site.devctl_ok(&alice, &["gpus"]);
    println!("$ devctl gpus\n{out}");
    assert!(
        out.contains("FAILED: Xid 79 (simulated): GPU has fallen off the bus"),
        "{out}"
    );

    // It comes back: still drained, so the next session gets GPU 2 and the one after waits.
    write_gpus(&site, &gpus, &gpu1, "");
    site.wait_until(
        "GPU 1 to be reported healthy",
        Duration::from_secs(30),
        || {
            let nodes: Value = site.devctl_json(&admin, &["gpus"]).ok()?;
            let gpu = nodes[0]["gpus"]
                .as_array()?
                .iter()
                .find(|g| g["info"]["uuid"] == gpu1.as_str())?
                .clone();
            (gpu["info"]["health"]["status"] == "healthy").then_some(())
        },
    );
    let out = site.devctl_ok(&alice, &["gpus"]);
    println!("$ devctl gpus\n{out}");
    assert!(out.contains("ok, DRAINED: failed: Xid 79"), "{out}");
    site.devctl_ok(&alice, &["session", "new", "--name", "second", "--wait"]);
    let second = site.wait_for_state(&alice, "second", "WAITING");
    assert_eq!(second["gpus"][0], SimGpu::a100(2).uuid.as_str());
    site.devctl_ok(&alice, &["session", "new", "--name", "third"]);
    let third: Value = site
        .devctl_json(&alice, &["session", "show", "third"])
        .expect("show third");
    assert_eq!(third["state"], "PENDING");

    // An admin puts it back in service: the waiting session gets it.
    let out = site.devctl_ok(&admin, &["admin", "gpu", "undrain", &gpu1]);
    println!("$ devctl admin gpu undrain {gpu1}\n{out}");
    let third = site.wait_for_state(&alice, "third", "WAITING");
    assert_eq!(third["gpus"][0], gpu1.as_str());
}
