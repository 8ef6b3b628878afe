//! Batch jobs end to end (issue 11's main scenario): a session frozen with a script that
//! checkpoints on SIGUSR1, submitted as a restartable job on the site's only GPU, halted for an
//! interactive session once past its min duration, re-queued with `ONGRID_RESTART_COUNT=1`,
//! finding its checkpoint; logs kept after the container is gone; other users locked out.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use chrono::{DateTime, Utc};
use ongrid_e2e::{inspect_container, SimGpu, Site, User};
use serde_json::Value;

/// The job's program, written into the session as root (the home volume is not part of a frozen
/// image): on SIGUSR1 it writes its restart count as the checkpoint and exits with 123.
const JOB_SCRIPT: &str = r#"#!/bin/bash
trap 'echo "$ONGRID_RESTART_COUNT" > /ongrid/work/checkpoint; echo "checkpointed restart=$ONGRID_RESTART_COUNT"; exit 123' USR1
echo "restart=$ONGRID_RESTART_COUNT checkpoint=$(cat /ongrid/work/checkpoint 2>/dev/null)"
while true; do sleep 1; done
"#;
const JOB_PATH: &str = "/usr/local/bin/ongrid-e2e-job";
const MIN_DURATION_SECS: i64 = 8;

/// Removes the frozen Docker image when the test ends, also when it failed.
struct DockerImage(String);

impl Drop for DockerImage {
    fn drop(&mut self) {
        let _ = Command::new("docker")
            .args(["image", "rm", "-f", &self.0])
            .output();
    }
}

fn job_show(site: &Site, user: &User, id: &str) -> Value {
    site.devctl_json(user, &["job", "show", id])
        .unwrap_or_else(|e| panic!("job show {id}: {e:#}\n{}", site.logs()))
}

fn wait_for_job(site: &Site, user: &User, id: &str, state: &str, timeout: Duration) -> Value {
    site.wait_until(&format!("job {id} to be {state}"), timeout, || {
        let view: Value = site.devctl_json(user, &["job", "show", id]).ok()?;
        (view["state"] == state).then_some(view)
    })
}

fn container_of(id: &str) -> String {
    format!("ongrid-job-{}", id.replace('-', ""))
}

fn time(value: &Value) -> DateTime<Utc> {
    value
        .as_str()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("a time: {value}"))
}

fn logs(site: &Site, user: &User, id: &str) -> String {
    site.devctl_ok(user, &["job", "logs", id])
}

fn container_env(name: &str) -> Vec<String> {
    let c = inspect_container(name).unwrap_or_else(|| panic!("container {name} exists"));
    c["Config"]["Env"]
        .as_array()
        .expect("env")
        .iter()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect()
}

#[test]
fn a_restartable_job_halts_for_a_session_and_resumes_from_its_checkpoint() {
    let mut site = Site::start(&[SimGpu::a100(1)]);
    let alice = site.user("Alice");
    let bob = site.user("Bob");
    let login = site.login_of("Alice");
    let _image = DockerImage(format!("ongrid/{login}/job:v1"));

    // Alice's session gets the script, as root, and is frozen into job:v1.
    site.devctl_ok(&alice, &["session", "new", "--name", "dev", "--wait"]);
    let view = site.wait_for_state(&alice, "dev", "WAITING");
    let container = view["container"].as_str().expect("container").to_owned();
    let mut child = Command::new("docker")
        .args(["exec", "-i", "-u", "0", &container, "sh", "-c"])
        .arg(format!("cat > {JOB_PATH} && chmod 755 {JOB_PATH}"))
        .stdin(Stdio::piped())
        .spawn()
        .expect("docker exec");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(JOB_SCRIPT.as_bytes())
        .expect("write the script");
    assert!(child.wait().expect("docker exec").success());
    let frozen = site.devctl_ok(&alice, &["freeze", "dev", "--tag", "job:v1"]);
    assert!(frozen.starts_with("image job:v1 is READY"), "{frozen}");
    let digest = site
        .devctl_json::<Value>(&alice, &["image", "show", "job:v1"])
        .expect("image show")["digest"]
        .as_str()
        .expect("digest")
        .to_owned();
    // The session goes, so the GPU is free for the job.
    site.devctl_ok(&alice, &["session", "rm", "dev"]);

    // Bob can run neither the tag (he has none) nor the digest of Alice's private image.
    for image in ["job:v1", digest.as_str()] {
        let out = site.devctl(&bob, &["job", "submit", "--image", image, "--", JOB_PATH]);
        assert!(
            !out.status.success(),
            "bob ran alice's image {image}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }

    let min = format!("{MIN_DURATION_SECS}s");
    // `--json` goes before `--` (devctl_json would append it to the job's command).
    let submitted = site.devctl_ok(
        &alice,
        &[
            "job",
            "submit",
            "--image",
            "job:v1",
            "--gpus",
            "1",
            "--max-duration",
            "1h",
            "--min-duration",
            &min,
            "--restartable",
            "--json",
            "--",
            JOB_PATH,
        ],
    );
    let submitted: Value = serde_json::from_str(&submitted).expect("the JSON of job submit");
    let first = submitted["id"].as_str().expect("job id").to_owned();
    let running = wait_for_job(&site, &alice, &first, "RUNNING", Duration::from_secs(180));
    assert_eq!(running["node"], site.node.as_str());
    assert_eq!(running["chain"]["restart_count"], 0);
    site.wait_until(
        "the first job's start line",
        Duration::from_secs(30),
        || {
            logs(&site, &alice, &first)
                .contains("restart=0 checkpoint=\n")
                .then_some(())
        },
    );
    let env = container_env(&container_of(&first));
    assert!(
        env.contains(&"ONGRID_RESTART_COUNT=0".to_owned()),
        "{env:?}"
    );
    assert!(
        env.contains(&format!("CUDA_VISIBLE_DEVICES={}", SimGpu::a100(1).uuid)),
        "{env:?}"
    );

    // Bob neither sees nor cancels Alice's job.
    assert!(!site.devctl(&bob, &["job", "show", &first]).status.success());
    assert!(!site
        .devctl(&bob, &["job", "cancel", &first])
        .status
        .success());
    let bobs: Value = site.devctl_json(&bob, &["job", "ls"]).expect("job ls");
    assert_eq!(bobs.as_array().map(Vec::len), Some(0), "{bobs}");

    // Bob's session needs the only GPU: the job is halted once past its min duration.
    site.devctl_ok(&bob, &["session", "new", "--name", "interactive"]);
    let session = site.wait_until("bob's session to start", Duration::from_secs(90), || {
        let view: Value = site
            .devctl_json(&bob, &["session", "show", "interactive"])
            .ok()?;
        (view["state"] == "WAITING").then_some(view)
    });
    let halted = wait_for_job(&site, &alice, &first, "HALTED", Duration::from_secs(30));
    let transitions = halted["transitions"].as_array().expect("transitions");
    let must_halt = transitions
        .iter()
        .find(|t| t["to"] == "MUSTHALT")
        .unwrap_or_else(|| panic!("no MUSTHALT transition: {halted}"));
    // Never halted within its min duration.
    let ran_for = time(&must_halt["at"]) - time(&halted["started_at"]);
    assert!(
        ran_for >= chrono::Duration::seconds(MIN_DURATION_SECS),
        "halted after {ran_for} only: {halted}"
    );
    // Every step is stored, HALTING too (also when the exit came within one sync of the signal).
    let states: Vec<&str> = transitions
        .iter()
        .filter_map(|t| t["to"].as_str())
        .collect();
    assert_eq!(
        states,
        ["QUEUED", "RUNNING", "MUSTHALT", "HALTING", "HALTED"],
        "{halted}"
    );
    let last = transitions.last().expect("a transition");
    assert_eq!(last["reason"]["reason"], "halted_cleanly", "{halted}");
    assert_eq!(halted["exit_code"], 123, "{halted}");
    let shown = site.devctl_ok(&alice, &["job", "show", &first]);
    assert!(
        shown.contains("halted for an interactive session needing"),
        "{shown}"
    );
    assert!(!shown.contains(&site.login_of("Bob")), "{shown}");
    assert!(
        session["transitions"]
            .as_array()
            .expect("session transitions")
            .iter()
            .any(|t| t["reason"]
                .as_str()
                .is_some_and(|r| r.ends_with("it preempted batch work"))),
        "{session}"
    );

    // The chain goes on as a new job, queued behind Bob's session.
    let second = halted["next_job"]
        .as_str()
        .unwrap_or_else(|| panic!("no next job: {halted}"))
        .to_owned();
    let requeued = job_show(&site, &alice, &second);
    assert_eq!(requeued["state"], "QUEUED", "{requeued}");
    assert_eq!(requeued["chain"]["restart_count"], 1);
    assert_eq!(requeued["chain"]["initial_job"], first.as_str());
    assert_eq!(requeued["previous_job"], first.as_str());

    // The first job's output outlives its container.
    site.wait_until(
        "the first job's container to go",
        Duration::from_secs(60),
        || {
            inspect_container(&container_of(&first))
                .is_none()
                .then_some(())
        },
    );
    let first_logs = logs(&site, &alice, &first);
    assert!(
        first_logs.contains("restart=0 checkpoint=\n")
            && first_logs.contains("checkpointed restart=0"),
        "{first_logs}"
    );

    // Bob leaves: the re-queued job runs and finds the checkpoint.
    site.devctl_ok(&bob, &["session", "rm", "interactive"]);
    wait_for_job(&site, &alice, &second, "RUNNING", Duration::from_secs(60));
    site.wait_until(
        "the re-queued job's start line",
        Duration::from_secs(30),
        || {
            logs(&site, &alice, &second)
                .contains("restart=1 checkpoint=0\n")
                .then_some(())
        },
    );
    let env = container_env(&container_of(&second));
    for expected in [
        "ONGRID_RESTART_COUNT=1".to_owned(),
        format!("ONGRID_RESTART_INITIAL_JOB_ID={first}"),
        format!("ONGRID_JOB_ID={second}"),
    ] {
        assert!(env.contains(&expected), "{expected} missing: {env:?}");
    }

    // Bob cannot cancel it; Alice can, and its container goes.
    assert!(!site
        .devctl(&bob, &["job", "cancel", &second])
        .status
        .success());
    wait_for_job(&site, &alice, &second, "RUNNING", Duration::from_secs(5));
    site.devctl_ok(&alice, &["job", "cancel", &second]);
    let cancelled = wait_for_job(&site, &alice, &second, "CANCELLED", Duration::from_secs(30));
    assert_eq!(cancelled["next_job"], Value::Null, "{cancelled}");
    site.wait_until(
        "the cancelled job's container to go",
        Duration::from_secs(60),
        || {
            inspect_container(&container_of(&second))
                .is_none()
                .then_some(())
        },
    );
}
