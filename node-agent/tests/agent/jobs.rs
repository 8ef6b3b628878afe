//! Batch jobs against the real Docker daemon: a job's image rebuilt from its SIF (made here by
//! ongrid_images from an export of `ongrid/dev:latest`), its output and exit code; a job that
//! traps SIGUSR1, writes a checkpoint into the chain's directory and exits 123, followed by a
//! restarted agent; and a job that ignores SIGUSR1, killed after the real 15 s grace.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use chrono::Utc;
use ongrid_agent::jobs::{Jobs, JobsConfig};
use ongrid_agent::runtime::GpuAccess;
use ongrid_core::api::{ContainerLimits, ContainerUser};
use ongrid_core::job::{
    self, DesiredJob, JobId, JobImage, JobRun, ObservedJob, ObservedJobStatus, HALT_GRACE,
};
use ongrid_core::{Dn, GpuId, MemorySize, UserName};
use ongrid_images::{Compression, FreezeRequest, ImageConfig, Provenance};

use crate::{docker, exists, unique, TestNode, IMAGE};

const GPU: &str = "GPU-11111111-2222-3333-4444-555555555501";

struct JobNode {
    node: TestNode,
    dir: tempfile::TempDir,
}

impl JobNode {
    async fn new() -> Self {
        Self {
            node: TestNode::new().await,
            dir: tempfile::tempdir().expect("temp dir"),
        }
    }

    fn store(&self) -> std::path::PathBuf {
        self.dir.path().join("images")
    }

    fn jobs_dir(&self) -> std::path::PathBuf {
        self.dir.path().join("jobs")
    }

    /// An agent's job manager (a second one is a restarted agent).
    fn jobs(&self) -> Jobs {
        Jobs::new(
            self.node.runtime.clone(),
            self.node.node.clone(),
            GpuAccess::EnvironmentOnly,
            self.node.guard(),
            Some(JobsConfig {
                image_store: self.store(),
                dir: self.jobs_dir(),
                halt_grace: HALT_GRACE,
            }),
        )
    }

    fn job(&self, image: JobImage, script: &str) -> DesiredJob {
        let id = JobId::new_random();
        DesiredJob {
            job_id: id,
            chain_id: id,
            owner: Dn::parse("/DC=org/DC=example/CN=Test User").expect("valid DN"),
            user: ContainerUser {
                name: UserName::parse(&format!("u{}", unique())).expect("valid user name"),
                uid: 23456,
            },
            image,
            command: job::Command::new(vec!["bash".into(), "-c".into(), script.into()])
                .expect("command"),
            env: BTreeMap::from([("ONGRID_JOB_ID".to_owned(), id.to_string())]),
            gpus: vec![GpuId::parse(GPU).expect("uuid")],
            limits: ContainerLimits {
                millicpus: 500,
                memory: MemorySize::parse("256MiB").expect("size"),
                pids: 256,
            },
            mount_home: false,
            run: JobRun::Run,
            log_offset: 0,
        }
    }
}

/// The dev image as it is: no build needed.
fn dev_image() -> JobImage {
    JobImage {
        digest: format!("sha256:{}", "0".repeat(64)),
        docker_image: IMAGE.to_owned(),
    }
}

/// Syncs (apply, report) until `done` says the report is what the test waits for, keeping the
/// output the way the manager would (moving its offset on). Panics after `limit`.
async fn sync_until(
    jobs: &mut Jobs,
    job: &mut DesiredJob,
    output: &mut Vec<u8>,
    limit: Duration,
    what: &str,
    mut done: impl FnMut(&ObservedJob, &[u8]) -> bool,
) -> ObservedJob {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        jobs.apply(std::slice::from_ref(job)).await;
        let observed = jobs
            .report()
            .await
            .into_iter()
            .find(|o| o.job_id == job.job_id)
            .expect("the job is reported");
        if let Some(chunk) = &observed.log {
            assert_eq!(chunk.offset, job.log_offset, "chunks follow the offset");
            output.extend_from_slice(&chunk.data);
            job.log_offset += chunk.data.len() as u64;
        }
        if let ObservedJobStatus::Failed { error } = &observed.status {
            panic!("the job failed: {error}");
        }
        if done(&observed, output) {
            return observed;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}; last report {observed:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn complete(observed: &ObservedJob) -> bool {
    matches!(observed.status, ObservedJobStatus::Exited { .. })
        && observed.log.as_ref().is_some_and(|l| l.complete)
}

/// Freezes `ongrid/dev:latest` into a SIF in `store` with ongrid_images, as a freeze would.
fn freeze_dev_image(store: &Path) -> ongrid_images::Frozen {
    let name = format!("ongrid-jobtest-export-{}", unique());
    docker(&["create", "--name", &name, IMAGE, "true"]);
    let mut export = Command::new("docker")
        .args(["export", &name])
        .stdout(Stdio::piped())
        .spawn()
        .expect("docker export");
    let mut stdout = export.stdout.take().expect("piped");
    let cancel = AtomicBool::new(false);
    let result = ongrid_images::freeze(FreezeRequest {
        export: &mut stdout,
        config: ImageConfig {
            env: vec![
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
                "FROZEN_GREETING=hello from the SIF".into(),
            ],
            working_dir: Some("/tmp".into()),
            entrypoint: Vec::new(),
            cmd: vec!["/bin/bash".into()],
            user: None,
        },
        provenance: Provenance {
            owner: "/DC=org/DC=example/CN=Test User".into(),
            session: "train1".into(),
            base_image: IMAGE.into(),
            reference: "jobtest:v1".into(),
            created_at: Utc::now(),
        },
        compression: Compression::Gzip,
        store,
        estimated_size: 0,
        progress: &mut |_| {},
        cancel: &cancel,
    });
    let _ = export.wait();
    docker(&["rm", "-f", &name]);
    result.expect("the dev image freezes")
}

/// Removes a Docker image when dropped.
struct ImageCleanup(String);

impl Drop for ImageCleanup {
    fn drop(&mut self) {
        let _ = Command::new("docker").args(["rmi", "-f", &self.0]).output();
    }
}

#[tokio::test]
async fn a_job_runs_from_its_sif_when_docker_lacks_the_image() {
    let node = JobNode::new().await;
    let frozen = tokio::task::spawn_blocking({
        let store = node.store();
        move || freeze_dev_image(&store)
    })
    .await
    .expect("freeze task");
    let reference = format!("ongrid-jobtest/{}:v1", unique());
    let _image = ImageCleanup(reference.clone());
    assert!(!exists("image", &reference), "the image must be built");
    let image = JobImage {
        digest: frozen.digest.clone(),
        docker_image: reference.clone(),
    };
    let mut job = node.job(
        image,
        "echo \"$FROZEN_GREETING\"; echo to-stderr >&2; echo \"cwd=$(pwd) uid=$(id -u) gpus=$CUDA_VISIBLE_DEVICES\"; exit 7",
    );
    let mut jobs = node.jobs();
    let mut output = Vec::new();
    let mut saw_preparing = false;
    let observed = sync_until(
        &mut jobs,
        &mut job,
        &mut output,
        Duration::from_secs(300),
        "the job to run from its SIF and exit",
        |observed, _| {
            if let ObservedJobStatus::Preparing { detail } = &observed.status {
                saw_preparing |= detail.contains("from its SIF");
            }
            complete(observed)
        },
    )
    .await;
    assert!(saw_preparing, "the build is reported while it runs");
    let ObservedJobStatus::Exited {
        exit_code,
        oom_killed,
        killed,
        started_at,
        finished_at,
        signalled_at,
    } = observed.status
    else {
        unreachable!()
    };
    assert_eq!((exit_code, oom_killed, killed), (7, false, false));
    assert_eq!(
        signalled_at, None,
        "a job that was never halted was never signalled"
    );
    assert!(started_at <= finished_at);
    let text = String::from_utf8_lossy(&output);
    assert!(
        text.contains("hello from the SIF"),
        "the SIF's environment: {text}"
    );
    assert!(text.contains("to-stderr"), "stderr is kept: {text}");
    assert!(
        text.contains(&format!("cwd=/ongrid/work uid=23456 gpus={GPU}")),
        "{text}"
    );
    assert!(exists("image", &reference), "the image was built");
    let config = &crate::inspect("image", &reference)["Config"];
    assert_eq!(config["WorkingDir"], "/tmp", "the frozen working directory");
    assert_eq!(config["Cmd"], serde_json::json!(["/bin/bash"]));

    // The container is hardened like a dev container.
    let container = crate::inspect("container", &job.job_id.container_name());
    assert_eq!(container["Config"]["User"], "23456:23456");
    assert_eq!(
        container["Config"]["Labels"]["ongrid.job"],
        job.job_id.to_string()
    );
    assert_eq!(
        container["HostConfig"]["CapDrop"],
        serde_json::json!(["ALL"])
    );
    assert_eq!(
        container["HostConfig"]["SecurityOpt"],
        serde_json::json!(["no-new-privileges"])
    );
    let mounts = container["Mounts"].as_array().expect("mounts");
    assert_eq!(mounts.len(), 1, "only the chain's directory: {mounts:?}");
    assert_eq!(mounts[0]["Destination"], job::WORK_DIR_IN_CONTAINER);

    // Gone from the desired state: container, network and log go.
    jobs.apply(&[]).await;
    assert!(!exists("container", &job.job_id.container_name()));
    assert_eq!(
        docker(&[
            "network",
            "ls",
            "-q",
            "--filter",
            &format!("label=ongrid.job={}", job.job_id)
        ]),
        ""
    );
}

#[tokio::test]
async fn a_halted_job_checkpoints_and_exits_123_across_an_agent_restart() {
    let node = JobNode::new().await;
    let mut job = node.job(
        dev_image(),
        "trap 'echo epoch-7 > /ongrid/work/checkpoint; echo halted; exit 123' USR1; \
         echo started; while true; do sleep 0.1; done",
    );
    let mut output = Vec::new();
    let mut jobs = node.jobs();
    sync_until(
        &mut jobs,
        &mut job,
        &mut output,
        Duration::from_secs(60),
        "the job to start",
        |observed, output| {
            matches!(observed.status, ObservedJobStatus::Running { .. })
                && String::from_utf8_lossy(output).contains("started")
        },
    )
    .await;

    // A restarted agent adopts the job: same container, never a second one.
    let container_id = crate::inspect("container", &job.job_id.container_name())["Id"].clone();
    let mut jobs = node.jobs();
    job.run = JobRun::Halt { since: Utc::now() };
    let observed = sync_until(
        &mut jobs,
        &mut job,
        &mut output,
        Duration::from_secs(30),
        "the job to exit after SIGUSR1",
        |observed, _| complete(observed),
    )
    .await;
    assert_eq!(
        crate::inspect("container", &job.job_id.container_name())["Id"],
        container_id
    );
    let ObservedJobStatus::Exited {
        exit_code, killed, ..
    } = observed.status
    else {
        unreachable!()
    };
    assert_eq!((exit_code, killed), (job::HALT_EXIT_CODE, false));
    let text = String::from_utf8_lossy(&output);
    assert!(
        text.contains("started\n") && text.contains("halted\n"),
        "{text}"
    );
    let checkpoint = node
        .jobs_dir()
        .join(job.chain_id.to_string())
        .join("checkpoint");
    assert_eq!(
        std::fs::read_to_string(&checkpoint).expect("the checkpoint is in the chain's directory"),
        "epoch-7\n"
    );
    let meta = std::fs::metadata(checkpoint.parent().expect("dir")).expect("chain dir");
    assert_eq!(
        std::os::unix::fs::MetadataExt::uid(&meta),
        23456,
        "the chain's directory is the user's"
    );
    jobs.apply(&[]).await;
    assert!(
        checkpoint.exists(),
        "the chain's directory outlives the job"
    );
}

#[tokio::test]
async fn a_job_that_ignores_sigusr1_is_killed_after_the_grace() {
    let node = JobNode::new().await;
    let mut job = node.job(
        dev_image(),
        "trap '' USR1; echo started; while true; do sleep 0.1; done",
    );
    let mut output = Vec::new();
    let mut jobs = node.jobs();
    sync_until(
        &mut jobs,
        &mut job,
        &mut output,
        Duration::from_secs(60),
        "the job to start",
        |_, output| String::from_utf8_lossy(output).contains("started"),
    )
    .await;
    let since = Utc::now();
    job.run = JobRun::Halt { since };
    let mut saw_halting = false;
    let observed = sync_until(
        &mut jobs,
        &mut job,
        &mut output,
        HALT_GRACE + Duration::from_secs(30),
        "the job to be killed",
        |observed, _| {
            saw_halting |= matches!(observed.status, ObservedJobStatus::Halting { .. });
            complete(observed)
        },
    )
    .await;
    assert!(saw_halting, "the job is halting during the grace");
    let ObservedJobStatus::Exited {
        exit_code,
        killed,
        finished_at,
        ..
    } = observed.status
    else {
        unreachable!()
    };
    assert!(killed);
    assert_eq!(exit_code, 137, "SIGKILL");
    assert!(
        finished_at - since >= chrono::Duration::from_std(HALT_GRACE).expect("grace"),
        "killed only after the grace: {finished_at} - {since}"
    );
    jobs.apply(&[]).await;
}
