//! Batch jobs end to end (issue 11's main scenario): a session frozen with a script that
//! checkpoints on SIGUSR1, submitted as a restartable job on the site's only GPU, halted for an
//! interactive session once past its min duration, re-queued with `ONGRID_RESTART_COUNT=1`,
//! finding its checkpoint; logs kept after the container is gone; other users locked out.
//!
//! Then the scheduling rules with short times in the site's config: exit 85 re-queues the
//! next job of the chain, which finds its checkpoint; max duration halts; a job that ignores
//! SIGUSR1 is killed after the agent's halt grace; a bucket of 1 runs one job at a time (the
//! other says why it waits); notAfter cancels a job still queued; a shared image runs for
//! another user only while shared.
//!
//! And a job on a MIG device: its container gets the MIG UUID, and the GPU set back to
//! `exclusive` while the job runs waits to drain, then leaves MIG mode once the job is gone.
//! And quick jobs in a row whose whole output is there the moment they show FINISHED.

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

/// Freezes a session of `user` holding `script` at [`JOB_PATH`] into the image `tag`, and
/// removes the session (its GPU is free again). The frozen Docker image (removed on drop) and
/// the image's digest.
fn frozen_job_image(
    site: &Site,
    user: &User,
    first_name: &str,
    tag: &str,
    script: &str,
) -> (DockerImage, String) {
    let login = site.login_of(first_name);
    let image = DockerImage(format!("ongrid/{login}/{tag}"));
    site.devctl_ok(user, &["session", "new", "--name", "dev", "--wait"]);
    let view = site.wait_for_state(user, "dev", "WAITING");
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
        .write_all(script.as_bytes())
        .expect("write the script");
    assert!(child.wait().expect("docker exec").success());
    let frozen = site.devctl_ok(user, &["freeze", "dev", "--tag", tag]);
    assert!(
        frozen.starts_with(&format!("image {tag} is READY")),
        "{frozen}"
    );
    let digest = site
        .devctl_json::<Value>(user, &["image", "show", tag])
        .expect("image show")["digest"]
        .as_str()
        .expect("digest")
        .to_owned();
    site.devctl_ok(user, &["session", "rm", "dev"]);
    (image, digest)
}

/// `devctl job submit --image <image> <args> --json -- <command>`; the new job's id.
fn submit(site: &Site, user: &User, image: &str, args: &[&str], command: &[&str]) -> String {
    let mut all = vec!["job", "submit", "--image", image];
    all.extend_from_slice(args);
    // `--json` goes before `--` (devctl_json would append it to the job's command).
    all.push("--json");
    all.push("--");
    all.extend_from_slice(command);
    let out = site.devctl_ok(user, &all);
    let view: Value = serde_json::from_str(&out).expect("the JSON of job submit");
    view["id"].as_str().expect("job id").to_owned()
}

/// The reasons (their `reason` tags) of the job's transitions into `state`.
fn reasons_into(view: &Value, state: &str) -> Vec<String> {
    view["transitions"]
        .as_array()
        .expect("transitions")
        .iter()
        .filter(|t| t["to"] == state)
        .filter_map(|t| t["reason"]["reason"].as_str().map(str::to_owned))
        .collect()
}

/// When the job entered `state` (its last transition into it).
fn entered(view: &Value, state: &str) -> DateTime<Utc> {
    let transition = view["transitions"]
        .as_array()
        .expect("transitions")
        .iter()
        .rev()
        .find(|t| t["to"] == state)
        .unwrap_or_else(|| panic!("never {state}: {view}"));
    time(&transition["at"])
}

/// The GPU of `uuid` as `devctl gpus --json` shows it.
fn gpu_json(site: &Site, user: &User, uuid: &str) -> Option<Value> {
    let nodes: Vec<Value> = site.devctl_json(user, &["gpus"]).ok()?;
    nodes
        .iter()
        .flat_map(|n| n["gpus"].as_array().cloned().unwrap_or_default())
        .find(|g| g["info"]["uuid"] == uuid)
}

/// Issue 26, item 13: quick jobs in a row, each read the moment `job show` says FINISHED.
/// Their output must be there in whole then, not a sync later: the agent reports a job's exit
/// in the same report as the last of its output, and the manager stores the output first.
#[test]
fn a_quick_jobs_output_is_all_there_as_soon_as_it_shows_finished() {
    let mut site = Site::start(&[SimGpu::a100(1)]);
    let alice = site.user("Alice");
    let (_image, _) = frozen_job_image(&site, &alice, "Alice", "echo:v1", JOB_SCRIPT);
    for round in 1..=3 {
        let text = format!("hello {round}");
        let id = submit(&site, &alice, "echo:v1", &[], &["echo", &text]);
        let finished = wait_for_job(&site, &alice, &id, "FINISHED", Duration::from_secs(60));
        // Nothing in between: `devctl job logs` without -f, as a user would type it.
        let output = logs(&site, &alice, &id);
        assert_eq!(
            output,
            format!("{text}\n"),
            "job {id} showed FINISHED ({finished}) but its logs were {output:?}\n{}",
            site.logs()
        );
        assert_eq!(finished["output_complete"], true, "{finished}");
        assert_eq!(finished["exit_code"], 0, "{finished}");
    }
}

#[test]
fn a_job_on_a_mig_device_gets_its_uuid_and_its_gpu_leaves_mig_mode_after_it() {
    let mig_gpu = SimGpu {
        uuid: "GPU-a100a100-0000-4000-8000-000000008001".to_owned(),
        model: "NVIDIA A100-SXM4-80GB",
        capability: "8.0",
        memory: "81920MiB",
    };
    let mut site = Site::start(&[SimGpu::a100(1), mig_gpu.clone()]);
    let alice = site.user("Alice");
    let admin = site.admin.clone();
    site.devctl_ok(
        &admin,
        &[
            "admin",
            "gpu",
            "mode",
            &mig_gpu.uuid,
            "mig:3g.40gb*1+2g.20gb*2",
        ],
    );
    let devices: Vec<Value> = site.wait_until(
        "the agent to report the MIG devices",
        Duration::from_secs(30),
        || {
            let gpu = gpu_json(&site, &admin, &mig_gpu.uuid)?;
            let devices = gpu["info"]["mig_devices"].as_array()?.clone();
            (devices.len() == 3).then_some(devices)
        },
    );
    // Frozen from a session on the whole GPU (the one in MIG mode is never given whole).
    let (_image, _) = frozen_job_image(&site, &alice, "Alice", "job:v1", JOB_SCRIPT);

    // A job asking for a 1g device gets the least sufficient free one, a 2g.20gb.
    let out = site.devctl_ok(
        &alice,
        &[
            "job", "submit", "--image", "job:v1", "--mig", "1g.10gb", "--", JOB_PATH,
        ],
    );
    let id = out
        .split_whitespace()
        .nth(1)
        .expect("job submit names the job")
        .to_owned();
    let running = wait_for_job(&site, &alice, &id, "RUNNING", Duration::from_secs(180));
    let device = running["gpus"][0].as_str().expect("a device").to_owned();
    assert!(
        devices[1..].iter().any(|d| d["uuid"] == device.as_str()),
        "{device} is not one of the 2g.20gb devices: {running}"
    );
    // Its container gets the MIG UUID as its only device.
    let env = site.wait_until("the job's container", Duration::from_secs(60), || {
        let env = inspect_container(&container_of(&id))?;
        Some(
            env["Config"]["Env"]
                .as_array()?
                .iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect::<Vec<String>>(),
        )
    });
    assert!(
        env.contains(&format!("NVIDIA_VISIBLE_DEVICES={device}")),
        "{env:?}"
    );
    assert!(
        env.contains(&format!("CUDA_VISIBLE_DEVICES={device}")),
        "{env:?}"
    );
    println!("$ devctl job submit --image job:v1 --mig 1g.10gb -- {JOB_PATH}\n{out}");
    let out = site.devctl_ok(&alice, &["job", "ls"]);
    println!("$ devctl job ls\n{out}");
    assert!(out.contains("(mig:1g.10gb)"), "{out}");
    let out = site.devctl_ok(&alice, &["job", "show", &id]);
    println!("$ devctl job show {id}\n{out}");
    assert!(out.contains(&device), "{out}");

    // Back to exclusive while the job runs: the GPU waits to drain, and says so.
    let out = site.devctl_ok(
        &admin,
        &["admin", "gpu", "mode", &mig_gpu.uuid, "exclusive"],
    );
    println!("$ devctl admin gpu mode {} exclusive\n{out}", mig_gpu.uuid);
    assert!(
        out.contains("turns MIG mode off once no session or job uses them"),
        "{out}"
    );
    let out = site.wait_until("the GPU to wait to drain", Duration::from_secs(30), || {
        let out = site.devctl_ok(&admin, &["admin", "node", "ls"]);
        out.contains("waits to drain for MIG mode off")
            .then_some(out)
    });
    println!("$ devctl admin node ls\n{out}");
    assert!(out.contains("(1 waiting to drain)"), "{out}");

    // The job ends: the agent destroys the devices, turns MIG mode off, and the GPU is whole.
    site.devctl_ok(&alice, &["job", "cancel", &id]);
    site.wait_until("the GPU to leave MIG mode", Duration::from_secs(60), || {
        let gpu = gpu_json(&site, &admin, &mig_gpu.uuid)?;
        (gpu["info"]["mig_enabled"] == false
            && gpu["info"]["mig_devices"]
                .as_array()
                .is_none_or(Vec::is_empty)
            && gpu["free"] == 1)
            .then_some(())
    });
    let out = site.devctl_ok(&admin, &["gpus"]);
    println!("$ devctl gpus\n{out}");
    assert!(!out.contains("└ MIG-"), "{out}");
    let out = site.devctl_ok(&admin, &["admin", "node", "ls"]);
    assert!(!out.contains("waits to drain"), "{out}");
}

#[test]
fn a_restartable_job_halts_for_a_session_and_resumes_from_its_checkpoint() {
    let mut site = Site::start(&[SimGpu::a100(1)]);
    let alice = site.user("Alice");
    let bob = site.user("Bob");

    // Alice's session gets the script, as root, and is frozen into job:v1.
    let (_image, digest) = frozen_job_image(&site, &alice, "Alice", "job:v1", JOB_SCRIPT);

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

/// The rules' program: `checkpoint` exits 85 after writing a checkpoint, and 0 when it finds
/// one; `ignore` ignores SIGUSR1; anything else exits 123 on SIGUSR1.
const RULES_SCRIPT: &str = r#"#!/bin/bash
case "$1" in
checkpoint)
    if [ -f /ongrid/work/step ]; then
        echo "resumed from step $(cat /ongrid/work/step) restart=$ONGRID_RESTART_COUNT"
        exit 0
    fi
    echo 1 > /ongrid/work/step
    echo "wrote step 1, exiting 85"
    exit 85
    ;;
ignore)
    trap '' USR1
    echo "ignoring SIGUSR1"
    while true; do sleep 1; done
    ;;
*)
    trap 'echo "halted"; exit 123' USR1
    echo "running"
    # `wait` returns at the signal, so the trap runs at once, not after the second's sleep:
    # the site's halt grace is short.
    while true; do sleep 1 & wait $!; done
    ;;
esac
"#;

/// The tag of the image of [`job_rules_act_with_the_sites_short_times`].
const RULES: &str = "rules:v1";

/// The agent's halt grace in [`job_rules_act_with_the_sites_short_times`].
const SHORT_HALT_GRACE_SECS: i64 = 2;

#[test]
fn job_rules_act_with_the_sites_short_times() {
    let mut site = Site::start_configured(
        &[SimGpu::a100(1), SimGpu::a100(2)],
        "[jobs]\noutput_grace = \"1 minute\"\n",
        &format!("job_halt_grace = \"{SHORT_HALT_GRACE_SECS}s\""),
    );
    let alice = site.user("Alice");
    let bob = site.user("Bob");
    let (_image, digest) = frozen_job_image(&site, &alice, "Alice", "rules:v1", RULES_SCRIPT);
    let long = Duration::from_secs(120);

    // Exit 85: HALTED with the checkpoint kept, and the next job of the chain finds it.
    let first = submit(&site, &alice, RULES, &[], &[JOB_PATH, "checkpoint"]);
    let halted = wait_for_job(&site, &alice, &first, "HALTED", long);
    assert_eq!(
        reasons_into(&halted, "HALTED"),
        ["checkpoint_exit"],
        "{halted}"
    );
    assert_eq!(halted["exit_code"], 85, "{halted}");
    let next = halted["next_job"]
        .as_str()
        .unwrap_or_else(|| panic!("no next job: {halted}"))
        .to_owned();
    let finished = wait_for_job(&site, &alice, &next, "FINISHED", long);
    assert_eq!(finished["chain"]["restart_count"], 1, "{finished}");
    assert_eq!(
        finished["node"], halted["node"],
        "pinned to its checkpoint's node"
    );
    site.wait_until("the resumed job's output", Duration::from_secs(30), || {
        logs(&site, &alice, &next)
            .contains("resumed from step 1 restart=1\n")
            .then_some(())
    });
    assert!(logs(&site, &alice, &first).contains("wrote step 1, exiting 85"));

    // Max duration: halted when it is reached, saying so. Meanwhile a job that ignores
    // SIGUSR1 is halted by its owner and killed once the agent's short grace is over.
    let bounded = submit(&site, &alice, RULES, &["--max-duration", "4s"], &[JOB_PATH]);
    let stubborn = submit(&site, &alice, RULES, &[], &[JOB_PATH, "ignore"]);
    wait_for_job(&site, &alice, &stubborn, "RUNNING", long);
    site.wait_until(
        "the stubborn job's first line",
        Duration::from_secs(30),
        || {
            logs(&site, &alice, &stubborn)
                .contains("ignoring SIGUSR1")
                .then_some(())
        },
    );
    site.devctl_ok(&alice, &["job", "halt", &stubborn]);
    let killed = wait_for_job(&site, &alice, &stubborn, "HALTED", Duration::from_secs(60));
    assert_eq!(
        reasons_into(&killed, "HALTED"),
        ["ignored_halt_signal"],
        "{killed}"
    );
    let waited = entered(&killed, "HALTED") - entered(&killed, "MUSTHALT");
    assert!(
        waited >= chrono::Duration::seconds(SHORT_HALT_GRACE_SECS)
            && waited < chrono::Duration::seconds(15),
        "killed {waited} after the halt, with a grace of {SHORT_HALT_GRACE_SECS} s: {killed}"
    );
    let stopped = wait_for_job(&site, &alice, &bounded, "HALTED", Duration::from_secs(60));
    assert_eq!(
        reasons_into(&stopped, "MUSTHALT"),
        ["max_duration_reached"],
        "{stopped}"
    );
    assert_eq!(
        reasons_into(&stopped, "HALTED"),
        ["halted_cleanly"],
        "{stopped}"
    );
    let ran = entered(&stopped, "MUSTHALT") - time(&stopped["started_at"]);
    assert!(
        ran >= chrono::Duration::seconds(4),
        "halted after {ran}: {stopped}"
    );
    assert_eq!(
        stopped["next_job"],
        Value::Null,
        "not restartable: {stopped}"
    );
    let shown = site.devctl_ok(&alice, &["job", "show", &bounded]);
    assert!(
        shown.contains("halted: reached its max duration of 4 seconds"),
        "{shown}"
    );

    // A bucket of 1: the second job waits, saying why, though a GPU is free.
    let bucketed = |site: &Site| submit(site, &alice, RULES, &["--bucket", "sweep:1"], &[JOB_PATH]);
    let one = bucketed(&site);
    wait_for_job(&site, &alice, &one, "RUNNING", long);
    let two = bucketed(&site);
    // Two scheduling rounds (1 s apart) leave it queued.
    let since = Utc::now();
    let waiting = site.wait_until(
        "two rounds with the bucket full",
        Duration::from_secs(10),
        || {
            let view = job_show(&site, &alice, &two);
            (Utc::now() - since >= chrono::Duration::seconds(3)).then_some(view)
        },
    );
    assert_eq!(waiting["state"], "QUEUED", "{waiting}");
    assert_eq!(
        waiting["waiting"], "bucket sweep is full: 1 of your jobs in it hold GPUs, at most 1 may",
        "{waiting}"
    );

    // notAfter: a job that cannot start (two GPUs, one held) is cancelled once it passes.
    let not_after = (Utc::now() + chrono::Duration::seconds(4))
        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let late = submit(
        &site,
        &alice,
        RULES,
        &["--gpus", "2", "--not-after", &not_after],
        &[JOB_PATH],
    );
    let cancelled = wait_for_job(&site, &alice, &late, "CANCELLED", Duration::from_secs(30));
    assert_eq!(
        reasons_into(&cancelled, "CANCELLED"),
        ["not_started_by_not_after"],
        "{cancelled}"
    );
    assert_eq!(cancelled["started_at"], Value::Null, "{cancelled}");

    // The first of the bucket ends: the second starts.
    site.devctl_ok(&alice, &["job", "cancel", &one]);
    wait_for_job(&site, &alice, &two, "RUNNING", long);
    site.devctl_ok(&alice, &["job", "cancel", &two]);

    // A shared image: Bob runs it by Alice's login and tag only while it is shared.
    let shared_name = format!("{}/rules:v1", site.login_of("Alice"));
    for image in [shared_name.as_str(), digest.as_str()] {
        let out = site.devctl(&bob, &["job", "submit", "--image", image, "--", JOB_PATH]);
        assert!(
            !out.status.success(),
            "bob ran alice's private image {image}"
        );
    }
    site.devctl_ok(&alice, &["image", "share", "rules:v1"]);
    let listed = site.devctl_ok(&bob, &["image", "ls", "--shared"]);
    assert!(listed.contains(&shared_name), "{listed}");
    let bobs = submit(&site, &bob, &shared_name, &[], &[JOB_PATH, "checkpoint"]);
    let bobs_halted = wait_for_job(&site, &bob, &bobs, "HALTED", long);
    assert_eq!(
        bobs_halted["user_name"],
        site.login_of("Bob").as_str(),
        "{bobs_halted}"
    );
    site.devctl_ok(&alice, &["image", "unshare", "rules:v1"]);
    let out = site.devctl(
        &bob,
        &["job", "submit", "--image", &shared_name, "--", JOB_PATH],
    );
    assert!(!out.status.success(), "bob ran an image no longer shared");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("that you may run"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    if let Some(next) = bobs_halted["next_job"].as_str() {
        // Already queued or running: unsharing does not take it away.
        let view = job_show(&site, &bob, next);
        assert_ne!(view["state"], "FAILED", "{view}");
        let _ = site.devctl(&bob, &["job", "cancel", next]);
    }
}
