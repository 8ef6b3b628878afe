//! The Docker runtime and the reconciler against the real Docker daemon: the dev container's
//! identity and hardening, the home volume, adoption after a restart, a container that dies,
//! hold and release, a missing image, the nvidia device request, and stray containers.

use std::sync::Arc;

use ongrid_agent::reconcile::Reconciler;
use ongrid_agent::runtime::{ContainerRuntime, ContainerSpec, GpuAccess};
use ongrid_core::api::{ContainerState, DesiredSession, ObservedContainer, RunState};
use serde_json::{json, Value};

use crate::{docker, exists, inspect, unique, TestNode, IMAGE};

/// Runs a shell command in the container as its user.
fn exec(session: &DesiredSession, script: &str) -> String {
    docker(&[
        "exec",
        &session.session_id.container_name(),
        "bash",
        "-c",
        script,
    ])
}

async fn converge(
    reconciler: &mut Reconciler,
    desired: &[DesiredSession],
) -> Vec<ObservedContainer> {
    reconciler
        .converge(desired)
        .await
        .expect("Docker lists containers");
    reconciler.observe().await.expect("Docker lists containers")
}

fn only(report: &[ObservedContainer]) -> &ObservedContainer {
    assert_eq!(report.len(), 1, "{report:#?}");
    &report[0]
}

#[tokio::test]
async fn dev_container_runs_hardened_as_the_user() {
    let node = TestNode::new().await;
    let session = node.session();
    let mut reconciler = node.reconciler();
    let report = converge(&mut reconciler, std::slice::from_ref(&session)).await;
    let observed = only(&report);
    assert_eq!(observed.state, ContainerState::Running, "{observed:?}");
    assert_eq!(observed.error, None);

    let name = session.session_id.container_name();
    let login = session.user.name.as_str();
    let uid = session.user.uid;
    let container = inspect("container", &name);
    assert_eq!(container["Id"], observed.container_id.as_str());
    let config = &container["Config"];
    assert_eq!(config["User"], format!("{uid}:{uid}"));
    assert_eq!(config["Hostname"], "train1");
    assert_eq!(config["Cmd"], json!(["sleep", "infinity"]));
    let labels = &config["Labels"];
    assert_eq!(labels["ongrid.managed"], "true");
    assert_eq!(labels["ongrid.session"], session.session_id.to_string());
    assert_eq!(labels["ongrid.session.name"], "train1");
    assert_eq!(labels["ongrid.user"], login);
    assert_eq!(labels["ongrid.owner"], "/DC=org/DC=example/CN=Test User");
    assert_eq!(labels["ongrid.node"], node.node.as_str());

    let host = &container["HostConfig"];
    assert_eq!(host["CapDrop"], json!(["ALL"]));
    assert_eq!(host["CapAdd"], Value::Null);
    assert_eq!(host["SecurityOpt"], json!(["no-new-privileges"]));
    assert_eq!(host["Privileged"], false);
    assert_eq!(host["Init"], true);
    assert_eq!(host["NanoCpus"], 500_000_000);
    assert_eq!(host["Memory"], 256 * 1024 * 1024);
    assert_eq!(host["PidsLimit"], 256);
    assert_eq!(host["RestartPolicy"]["Name"], "no");
    assert_eq!(host["Binds"], Value::Null);
    assert_eq!(
        host["DeviceRequests"],
        Value::Null,
        "simulated GPUs get no device request"
    );
    let mounts = container["Mounts"].as_array().expect("mounts");
    assert_eq!(mounts.len(), 1, "only the home volume: {mounts:?}");
    assert_eq!(mounts[0]["Type"], "volume");
    assert_eq!(mounts[0]["Name"], format!("ongrid-home-{login}"));
    assert_eq!(mounts[0]["Destination"], format!("/home/{login}"));

    // Inside, as the user would be.
    assert_eq!(
        exec(&session, "id -un; id -u; id -gn; id -g"),
        format!("{login}\n{uid}\n{login}\n{uid}")
    );
    assert_eq!(
        exec(&session, "echo $HOME; pwd; echo $SHELL; echo $LANG"),
        format!("/home/{login}\n/home/{login}\n/bin/bash\nC.UTF-8")
    );
    assert_eq!(
        exec(
            &session,
            "echo $CUDA_VISIBLE_DEVICES $NVIDIA_VISIBLE_DEVICES"
        ),
        "GPU-11111111-2222-3333-4444-555555555501 GPU-11111111-2222-3333-4444-555555555501"
    );
    assert_eq!(exec(&session, "hostname"), "train1");
    assert_eq!(
        exec(&session, "touch ~/probe && stat -c %u ~ ~/probe"),
        format!("{uid}\n{uid}")
    );
    assert_eq!(
        exec(&session, "grep NoNewPrivs /proc/self/status"),
        "NoNewPrivs:\t1"
    );
    assert_eq!(
        exec(&session, "grep CapEff /proc/self/status"),
        "CapEff:\t0000000000000000"
    );
    assert_eq!(
        exec(&session, "grep CapBnd /proc/self/status"),
        "CapBnd:\t0000000000000000"
    );
    assert_eq!(
        exec(
            &session,
            "test -e /var/run/docker.sock && echo present || echo absent"
        ),
        "absent"
    );
    let init = exec(&session, "tr '\\0' ' ' < /proc/1/cmdline");
    assert!(
        init.contains("init") && init.ends_with("sleep infinity"),
        "PID 1 is {init:?}"
    );
    assert_eq!(
        exec(
            &session,
            "touch /etc/probe 2>/dev/null && echo writable || echo refused"
        ),
        "refused"
    );
}

#[tokio::test]
async fn home_volume_outlives_the_container_and_serves_the_next_session() {
    let node = TestNode::new().await;
    let first = node.session();
    let mut reconciler = node.reconciler();
    converge(&mut reconciler, std::slice::from_ref(&first)).await;
    exec(&first, "echo kept across sessions > ~/notes.txt");
    let volume = format!("ongrid-home-{}", first.user.name);
    assert_eq!(
        inspect("volume", &volume)["Labels"]["ongrid.managed"],
        "true"
    );
    assert_eq!(
        inspect("volume", &volume)["Labels"]["ongrid.user"],
        first.user.name.as_str()
    );

    // Not desired any more: stopped and removed, the volume stays.
    let report = converge(&mut reconciler, &[]).await;
    assert!(report.is_empty(), "{report:?}");
    assert!(!exists("container", &first.session_id.container_name()));
    assert!(exists("volume", &volume));

    let second = node.session_of(first.user.name.as_str(), first.user.uid);
    let report = converge(&mut reconciler, std::slice::from_ref(&second)).await;
    assert_eq!(only(&report).state, ContainerState::Running);
    assert_eq!(exec(&second, "cat ~/notes.txt"), "kept across sessions");
}

#[tokio::test]
async fn a_restarted_agent_adopts_and_a_dead_container_is_reported_not_restarted() {
    let node = TestNode::new().await;
    let session = node.session();
    let name = session.session_id.container_name();
    converge(&mut node.reconciler(), std::slice::from_ref(&session)).await;
    let before = inspect("container", &name);

    // A new agent (nothing remembered) sees the same desired state: it adopts.
    let mut restarted = node.reconciler();
    let report = converge(&mut restarted, std::slice::from_ref(&session)).await;
    let after = inspect("container", &name);
    assert_eq!(after["Id"], before["Id"]);
    assert_eq!(
        after["State"]["StartedAt"], before["State"]["StartedAt"],
        "not restarted"
    );
    assert_eq!(only(&report).state, ContainerState::Running);

    docker(&["kill", &name]);
    let report = converge(&mut restarted, std::slice::from_ref(&session)).await;
    let observed = only(&report);
    assert_eq!(
        observed.state,
        ContainerState::Exited {
            exit_code: 137,
            oom_killed: false,
            error: None
        }
    );
    assert_eq!(
        observed.error.as_deref(),
        Some("the dev container was killed by SIGKILL (exit code 137) without ongrid asking")
    );
    assert_eq!(
        inspect("container", &name)["State"]["Running"],
        false,
        "no silent restart"
    );
}

#[tokio::test]
async fn hold_and_release_keep_the_container_and_its_files() {
    let node = TestNode::new().await;
    let session = node.session();
    let name = session.session_id.container_name();
    let mut reconciler = node.reconciler();
    converge(&mut reconciler, std::slice::from_ref(&session)).await;
    exec(&session, "echo in the writable layer > /tmp/layer");
    let id = inspect("container", &name)["Id"].clone();

    let held = DesiredSession {
        run: RunState::Stopped,
        ..session.clone()
    };
    let report = converge(&mut reconciler, &[held]).await;
    let observed = only(&report);
    assert!(
        matches!(observed.state, ContainerState::Exited { .. }),
        "{observed:?}"
    );
    assert_eq!(observed.error, None, "a requested stop is not a failure");

    let report = converge(&mut reconciler, std::slice::from_ref(&session)).await;
    assert_eq!(only(&report).state, ContainerState::Running);
    assert_eq!(inspect("container", &name)["Id"], id, "the same container");
    assert_eq!(exec(&session, "cat /tmp/layer"), "in the writable layer");
}

#[tokio::test]
async fn a_missing_image_is_reported_with_the_fix() {
    let node = TestNode::new().await;
    let image = format!("ongrid/absent-{}:latest", unique());
    let session = DesiredSession {
        image: image.clone(),
        ..node.session()
    };
    let report = converge(&mut node.reconciler(), std::slice::from_ref(&session)).await;
    let observed = only(&report);
    assert_eq!(observed.state, ContainerState::Missing);
    assert_eq!(
        observed.error.as_deref(),
        Some(
            format!(
            "image {image} is not present on node {}: build or load it there (images/dev/build.sh)",
            node.node
        )
            .as_str()
        )
    );
    assert!(!exists("container", &session.session_id.container_name()));
}

#[tokio::test]
async fn real_gpus_get_the_nvidia_device_request() {
    let node = TestNode::new().await;
    let mut session = node.session();
    session
        .gpus
        .push(ongrid_core::GpuId::parse("MIG-c7384736-a75d-5afc-978f-d2f1294409fd").expect("uuid"));
    let spec = ContainerSpec::for_session(&node.node, &session, GpuAccess::NvidiaDeviceRequest);
    // Created only: starting needs the NVIDIA container toolkit, which this machine lacks.
    let id = node.runtime.create(&spec).await.expect("created");
    let requests = &inspect("container", &id)["HostConfig"]["DeviceRequests"];
    assert_eq!(
        requests,
        &json!([{
            "Driver": "nvidia",
            "Count": 0,
            "DeviceIDs": [
                "GPU-11111111-2222-3333-4444-555555555501",
                "MIG-c7384736-a75d-5afc-978f-d2f1294409fd"
            ],
            "Capabilities": [["gpu"]],
            "Options": null
        }])
    );
    node.runtime.remove(&id).await.expect("removed");
    assert!(!exists("container", &id));
    node.runtime
        .remove(&id)
        .await
        .expect("removing a removed container is no error");
}

#[tokio::test]
async fn strays_of_this_node_are_removed_and_other_nodes_are_left_alone() {
    let node = TestNode::new().await;
    let other = TestNode::new().await;
    let stray = docker(&[
        "create",
        "--label",
        "ongrid.managed=true",
        "--label",
        &format!("ongrid.node={}", node.node),
        IMAGE,
        "sleep",
        "infinity",
    ]);
    let foreign = docker(&[
        "create",
        "--label",
        "ongrid.managed=true",
        "--label",
        &format!("ongrid.node={}", other.node),
        IMAGE,
        "sleep",
        "infinity",
    ]);
    let report = converge(&mut node.reconciler(), &[]).await;
    assert!(report.is_empty(), "strays are not reported: {report:?}");
    assert!(!exists("container", &stray));
    assert!(exists("container", &foreign));
    let runtime: Arc<dyn ContainerRuntime> = other.runtime.clone();
    assert_eq!(runtime.list().await.expect("listed").len(), 1);
}
