use std::collections::BTreeMap;
use std::sync::Mutex;

use ongrid_core::api::{ContainerLimits, ContainerUser};
use ongrid_core::job::{Command, JobImage};
use ongrid_core::{Dn, GpuId, MemorySize, UserName};

use super::*;
use crate::network::fake::FakeFirewall;
use crate::runtime::fake::FakeRuntime;
use crate::runtime::LimitCeiling;

const IMAGE: &str = "ongrid-frozen/alice/mymodel:v1";

fn t0() -> DateTime<Utc> {
    DateTime::from_timestamp(1_800_000_000, 0).unwrap()
}

fn desired_job() -> DesiredJob {
    let id = JobId::new_random();
    DesiredJob {
        job_id: id,
        chain_id: id,
        owner: Dn::parse("/DC=org/DC=example/CN=Alice Smith").unwrap(),
        user: ContainerUser {
            name: UserName::parse("alice-smith").unwrap(),
            // The agent's own uid: the unit tests need not run as root to chown.
            uid: std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").unwrap()),
        },
        image: JobImage {
            digest: format!("sha256:{}", "ab".repeat(32)),
            docker_image: IMAGE.to_owned(),
        },
        command: Command::new(vec!["python".into(), "train.py".into()]).unwrap(),
        env: BTreeMap::from([
            ("EPOCHS".to_owned(), "20".to_owned()),
            ("CUDA_VISIBLE_DEVICES".to_owned(), "spoofed".to_owned()),
        ]),
        gpus: vec![GpuId::parse("GPU-11111111-2222-3333-4444-555555555501").unwrap()],
        limits: ContainerLimits {
            millicpus: 2000,
            memory: MemorySize::parse("4GiB").unwrap(),
            pids: 512,
        },
        mount_home: false,
        run: JobRun::Run,
        log_offset: 0,
    }
}

/// A clock tests move by hand.
#[derive(Clone)]
struct TestClock(Arc<Mutex<DateTime<Utc>>>);

impl TestClock {
    fn new() -> Self {
        Self(Arc::new(Mutex::new(t0())))
    }

    fn set(&self, time: DateTime<Utc>) {
        *self.0.lock().unwrap() = time;
    }

    fn clock(&self) -> Clock {
        let time = self.0.clone();
        Arc::new(move || *time.lock().unwrap())
    }
}

struct Fixture {
    runtime: Arc<FakeRuntime>,
    dir: tempfile::TempDir,
    clock: TestClock,
}

impl Fixture {
    fn new() -> Self {
        let runtime = Arc::new(FakeRuntime::new());
        runtime.add_image(IMAGE);
        Self {
            runtime,
            dir: tempfile::tempdir().unwrap(),
            clock: TestClock::new(),
        }
    }

    /// An agent's job manager; a second one over the same runtime and directory is a
    /// restarted agent.
    fn jobs(&self) -> Jobs {
        self.jobs_with(GpuAccess::EnvironmentOnly)
    }

    /// The job manager of an agent whose GPUs are reached through `gpu_access`.
    fn jobs_with(&self, gpu_access: GpuAccess) -> Jobs {
        Jobs::new(
            self.runtime.clone(),
            NodeName::parse("node1").unwrap(),
            gpu_access,
            NodeGuard {
                firewall: Arc::new(FakeFirewall::default()),
                subnet_pool: "10.213.0.0/16".parse().unwrap(),
                storage: Default::default(),
                ceiling: LimitCeiling::NONE,
            },
            Some(JobsConfig {
                image_store: self.dir.path().join("images"),
                dir: self.dir.path().join("jobs"),
                halt_grace: ongrid_core::job::HALT_GRACE,
            }),
        )
        .with_clock(self.clock.clock())
    }

    fn calls(&self) -> Vec<String> {
        self.runtime.take_calls()
    }

    /// The fake's id of the job's container.
    fn container(&self, job: &DesiredJob) -> String {
        self.runtime
            .jobs()
            .into_iter()
            .find(|(_, j)| j.status.job_id == job.job_id)
            .map(|(id, _)| id)
            .expect("the job has a container")
    }
}

async fn status(jobs: &mut Jobs, job: &DesiredJob) -> ObservedJob {
    jobs.report()
        .await
        .into_iter()
        .find(|o| o.job_id == job.job_id)
        .expect("every desired job is reported")
}

/// Two passes with the output followers' work before each (as syncs would have).
async fn converge(jobs: &mut Jobs, job: &DesiredJob) {
    jobs.settle_followers().await;
    jobs.apply(std::slice::from_ref(job)).await;
    jobs.settle_followers().await;
    jobs.apply(std::slice::from_ref(job)).await;
}

async fn wait_for_builds(jobs: &Jobs) {
    jobs.tasks().close();
    jobs.tasks().wait().await;
    jobs.tasks().reopen();
}

#[tokio::test]
async fn a_job_on_a_mig_device_gets_its_mig_uuid_in_the_device_request_and_environment() {
    let f = Fixture::new();
    let mut jobs = f.jobs_with(GpuAccess::NvidiaDeviceRequest);
    let mig = "MIG-c7384736-a75d-5afc-978f-d2f1294409fd";
    let job = DesiredJob {
        gpus: vec![GpuId::parse(mig).unwrap()],
        ..desired_job()
    };
    jobs.apply(std::slice::from_ref(&job)).await;
    let id = f.container(&job);
    let spec = f.runtime.jobs()[&id].spec.clone();
    let env: BTreeMap<_, _> = spec.env.iter().cloned().collect();
    assert_eq!(env["CUDA_VISIBLE_DEVICES"], mig);
    assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], mig);
    assert_eq!(spec.labels[LABEL_GPUS], mig);
    // What Docker is asked for: the nvidia driver with exactly the MIG device.
    let body = crate::runtime::docker::job_create_body(&spec);
    let requests = body.host_config.unwrap().device_requests.unwrap();
    assert_eq!(requests.len(), 1);
    assert_eq!(requests[0].driver.as_deref(), Some("nvidia"));
    assert_eq!(requests[0].device_ids, Some(vec![mig.to_owned()]));
}

#[tokio::test]
async fn a_job_is_created_and_started_once_and_never_restarted() {
    let f = Fixture::new();
    let mut jobs = f.jobs();
    let job = desired_job();
    jobs.apply(std::slice::from_ref(&job)).await;
    let id = f.container(&job);
    assert_eq!(
        f.calls(),
        [
            format!("create_job {}", job.job_id.container_name()),
            format!("start {id}")
        ]
    );
    assert!(matches!(
        status(&mut jobs, &job).await.status,
        ObservedJobStatus::Running { .. }
    ));

    // The container's configuration.
    let spec = f.runtime.jobs()[&id].spec.clone();
    assert_eq!(spec.command, ["python", "train.py"]);
    assert_eq!(spec.image, IMAGE);
    let env: BTreeMap<_, _> = spec.env.iter().cloned().collect();
    assert_eq!(env["EPOCHS"], "20");
    assert_eq!(
        env["CUDA_VISIBLE_DEVICES"], "GPU-11111111-2222-3333-4444-555555555501",
        "the agent sets the GPU variables"
    );
    assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], env["CUDA_VISIBLE_DEVICES"]);
    assert_eq!(spec.labels[LABEL_JOB], job.job_id.to_string());
    assert_eq!(spec.labels[LABEL_NODE], "node1");
    assert_eq!(spec.labels[LABEL_MANAGED], "true");
    assert_eq!(spec.labels[LABEL_USER], "alice-smith");
    assert_eq!(
        spec.work_dir,
        f.dir.path().join("jobs").join(job.chain_id.to_string())
    );
    assert!(spec.work_dir.is_dir(), "the chain's directory is made");
    assert!(!spec.mount_home);
    assert_eq!(
        f.runtime.take_network_calls(),
        [format!("ensure_network {}", spec.network)]
    );

    jobs.apply(std::slice::from_ref(&job)).await;
    assert_eq!(
        f.calls(),
        Vec::<String>::new(),
        "a running job is left alone"
    );

    f.runtime.exit_job(&id, 3, b"epoch 1\nepoch 2\n");
    converge(&mut jobs, &job).await;
    assert!(
        f.calls()
            .iter()
            .all(|c| !c.starts_with("start") && !c.starts_with("create")),
        "an exited job is never started again"
    );
    let observed = status(&mut jobs, &job).await;
    let ObservedJobStatus::Exited {
        exit_code, killed, ..
    } = observed.status
    else {
        panic!("{observed:?}");
    };
    assert_eq!((exit_code, killed), (3, false));
    let log = observed.log.expect("the output is reported");
    assert_eq!(log.data, b"epoch 1\nepoch 2\n");
    assert!(log.complete);
}

/// When the fake says the job's container finished.
fn finished_at(f: &Fixture, job: &DesiredJob) -> DateTime<Utc> {
    match f.runtime.jobs()[&f.container(job)].status.state {
        JobContainerState::Exited { finished_at, .. } => finished_at,
        other => panic!("the job has not exited: {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn an_exit_is_reported_in_the_same_report_as_the_last_of_the_output() {
    let f = Fixture::new();
    let mut jobs = f.jobs();
    let mut written = jobs.output_written();
    let job = desired_job();
    jobs.apply(std::slice::from_ref(&job)).await;
    let id = f.container(&job);
    written.mark_unchanged();
    // `echo hello`: it exits before any other pass of the agent.
    f.runtime.exit_job(&id, 0, b"hello\n");
    f.clock.set(finished_at(&f, &job));
    let observed = status(&mut jobs, &job).await;
    assert!(
        matches!(
            observed.status,
            ObservedJobStatus::Exited { exit_code: 0, .. }
        ),
        "{observed:?}"
    );
    let log = observed.log.expect("the output goes with the exit");
    assert_eq!(log.data, b"hello\n");
    assert!(
        log.complete,
        "the exit's report says the output is complete"
    );
    assert!(
        written.has_changed().unwrap(),
        "the output written is signalled to the sync loop"
    );
}

#[tokio::test(start_paused = true)]
async fn a_job_whose_output_is_not_all_in_is_reported_running_until_it_is() {
    let f = Fixture::new();
    let mut jobs = f.jobs();
    let mut job = desired_job();
    jobs.apply(std::slice::from_ref(&job)).await;
    let id = f.container(&job);
    f.runtime.hold_output(true);
    f.runtime.exit_job(&id, 0, b"hello\n");
    f.clock
        .set(finished_at(&f, &job) + chrono::Duration::seconds(1));
    let observed = status(&mut jobs, &job).await;
    assert!(
        matches!(observed.status, ObservedJobStatus::Running { .. }),
        "not reported ended while Docker has not sent the end: {observed:?}"
    );
    let log = observed.log.expect("what is in is sent");
    assert_eq!(
        (log.data.as_slice(), log.complete),
        (&b"hello\n"[..], false)
    );
    // The manager's answer: it has those bytes.
    job.log_offset = 6;
    jobs.apply(std::slice::from_ref(&job)).await;

    // Docker sends the end: the exit comes with it.
    let mut written = jobs.output_written();
    written.mark_unchanged();
    f.runtime.hold_output(false);
    written.changed().await.unwrap();
    let observed = status(&mut jobs, &job).await;
    assert!(
        matches!(observed.status, ObservedJobStatus::Exited { .. }),
        "{observed:?}"
    );
    let log = observed.log.expect("the end is said");
    assert!(log.data.is_empty() && log.complete, "{log:?}");
}

#[tokio::test(start_paused = true)]
async fn an_exit_whose_output_cannot_be_read_is_reported_after_the_limit() {
    let f = Fixture::new();
    let mut jobs = f.jobs();
    let job = desired_job();
    jobs.apply(std::slice::from_ref(&job)).await;
    let id = f.container(&job);
    f.runtime.hold_output(true);
    f.runtime.exit_job(&id, 2, b"partial");
    let limit = chrono::Duration::from_std(EXIT_OUTPUT_LIMIT).unwrap();
    f.clock
        .set(finished_at(&f, &job) + limit - chrono::Duration::seconds(1));
    assert!(matches!(
        status(&mut jobs, &job).await.status,
        ObservedJobStatus::Running { .. }
    ));
    f.clock.set(finished_at(&f, &job) + limit);
    let observed = status(&mut jobs, &job).await;
    assert!(
        matches!(
            observed.status,
            ObservedJobStatus::Exited { exit_code: 2, .. }
        ),
        "{observed:?}"
    );
    assert!(
        observed.log.is_none_or(|l| !l.complete),
        "its output is not said complete"
    );
    f.runtime.hold_output(false);
}

#[tokio::test]
async fn a_halt_signals_once_then_kills_after_the_grace() {
    let f = Fixture::new();
    let mut jobs = f.jobs();
    let mut job = desired_job();
    jobs.apply(std::slice::from_ref(&job)).await;
    let id = f.container(&job);
    f.calls();

    job.run = JobRun::Halt { since: t0() };
    f.clock.set(t0() + chrono::Duration::seconds(1));
    jobs.apply(std::slice::from_ref(&job)).await;
    assert_eq!(f.calls(), [format!("signal {id} SIGUSR1")]);
    f.clock.set(t0() + chrono::Duration::seconds(14));
    jobs.apply(std::slice::from_ref(&job)).await;
    assert_eq!(f.calls(), Vec::<String>::new(), "the signal is sent once");
    let ObservedJobStatus::Halting { signalled_at, .. } = status(&mut jobs, &job).await.status
    else {
        panic!("a signalled job is halting");
    };
    assert_eq!(signalled_at, t0() + chrono::Duration::seconds(1));

    // A restarted agent does not signal again.
    let mut restarted = f.jobs();
    restarted.apply(std::slice::from_ref(&job)).await;
    assert_eq!(f.calls(), Vec::<String>::new());

    f.clock.set(t0() + chrono::Duration::seconds(15));
    restarted.apply(std::slice::from_ref(&job)).await;
    assert_eq!(f.calls(), [format!("signal {id} SIGKILL")]);
    let ObservedJobStatus::Exited {
        exit_code, killed, ..
    } = status(&mut restarted, &job).await.status
    else {
        panic!("a killed job has exited");
    };
    assert_eq!((exit_code, killed), (137, true));
}

#[tokio::test]
async fn a_job_that_halts_in_time_exits_with_its_own_code() {
    let f = Fixture::new();
    let mut jobs = f.jobs();
    let mut job = desired_job();
    jobs.apply(std::slice::from_ref(&job)).await;
    let id = f.container(&job);
    job.run = JobRun::Halt { since: t0() };
    jobs.apply(std::slice::from_ref(&job)).await;
    f.runtime.exit_job(&id, 123, b"checkpoint written\n");
    f.clock.set(t0() + chrono::Duration::seconds(60));
    f.calls();
    jobs.apply(std::slice::from_ref(&job)).await;
    assert_eq!(
        f.calls(),
        Vec::<String>::new(),
        "an exited job is not killed"
    );
    let ObservedJobStatus::Exited {
        exit_code,
        killed,
        signalled_at,
        ..
    } = status(&mut jobs, &job).await.status
    else {
        panic!("the job exited");
    };
    assert_eq!((exit_code, killed), (123, false));
    // The exit report says when the signal went out, so the manager stores HALTING too.
    assert_eq!(signalled_at, Some(t0()));
}

#[tokio::test]
async fn kill_kills_at_once() {
    let f = Fixture::new();
    let mut jobs = f.jobs();
    let mut job = desired_job();
    jobs.apply(std::slice::from_ref(&job)).await;
    let id = f.container(&job);
    f.calls();
    job.run = JobRun::Kill;
    jobs.apply(std::slice::from_ref(&job)).await;
    assert_eq!(f.calls(), [format!("signal {id} SIGKILL")]);
    assert!(matches!(
        status(&mut jobs, &job).await.status,
        ObservedJobStatus::Exited { killed: true, .. }
    ));
}

#[tokio::test]
async fn a_restarted_agent_adopts_its_jobs_and_never_recreates_one() {
    let f = Fixture::new();
    let job = desired_job();
    f.jobs().apply(std::slice::from_ref(&job)).await;
    let id = f.container(&job);
    f.calls();

    let mut restarted = f.jobs();
    restarted.apply(std::slice::from_ref(&job)).await;
    assert_eq!(
        f.calls(),
        Vec::<String>::new(),
        "the running job is adopted"
    );
    assert!(matches!(
        status(&mut restarted, &job).await.status,
        ObservedJobStatus::Running { .. }
    ));

    // Someone removes the container: the job is not run a second time.
    f.runtime.remove(&id).await.unwrap();
    f.calls();
    let mut again = f.jobs();
    again.apply(std::slice::from_ref(&job)).await;
    assert_eq!(f.calls(), Vec::<String>::new());
    let ObservedJobStatus::Failed { error } = status(&mut again, &job).await.status else {
        panic!("a vanished job has failed");
    };
    assert!(error.contains("removed outside ongrid"), "{error}");
}

#[tokio::test]
async fn a_created_but_never_started_container_is_started_not_recreated() {
    let f = Fixture::new();
    let job = desired_job();
    f.runtime.fail("start");
    let mut jobs = f.jobs();
    jobs.apply(std::slice::from_ref(&job)).await;
    let ObservedJobStatus::Preparing { detail } = status(&mut jobs, &job).await.status else {
        panic!("not started yet");
    };
    assert!(detail.contains("the fake was told to fail"), "{detail}");
    f.runtime.heal();
    f.calls();
    f.jobs().apply(std::slice::from_ref(&job)).await;
    let id = f.container(&job);
    assert_eq!(f.calls(), [format!("start {id}")]);
}

#[tokio::test]
async fn a_missing_or_broken_sif_fails_the_job_with_what_to_do() {
    let f = Fixture::new();
    f.runtime.remove_image(IMAGE);
    let mut jobs = f.jobs();
    let job = desired_job();
    jobs.apply(std::slice::from_ref(&job)).await;
    assert!(matches!(
        status(&mut jobs, &job).await.status,
        ObservedJobStatus::Preparing { .. } | ObservedJobStatus::Failed { .. }
    ));
    wait_for_builds(&jobs).await;
    let ObservedJobStatus::Failed { error } = status(&mut jobs, &job).await.status else {
        panic!("a job without its SIF fails");
    };
    assert!(error.contains("is not in the image store"), "{error}");
    assert!(error.contains("[images] store"), "{error}");
    jobs.apply(std::slice::from_ref(&job)).await;
    wait_for_builds(&jobs).await;
    assert!(
        f.calls().iter().all(|c| !c.starts_with("create")),
        "no container without an image"
    );

    // A SIF that is not one.
    let other = desired_job();
    let mut other_image = other.clone();
    other_image.image.digest = format!("sha256:{}", "cd".repeat(32));
    let sif = ongrid_images::sif_path(&f.dir.path().join("images"), &"cd".repeat(32));
    std::fs::create_dir_all(sif.parent().unwrap()).unwrap();
    std::fs::write(&sif, b"not a SIF at all").unwrap();
    jobs.apply(std::slice::from_ref(&other_image)).await;
    wait_for_builds(&jobs).await;
    let ObservedJobStatus::Failed { error } = status(&mut jobs, &other_image).await.status else {
        panic!("a job with a broken SIF fails");
    };
    assert!(error.contains("is broken"), "{error}");
    assert!(error.contains("freeze the session again"), "{error}");
    assert!(f.runtime.imports().is_empty());
}

#[tokio::test]
async fn a_job_no_longer_listed_is_removed_with_its_files() {
    let f = Fixture::new();
    let mut jobs = f.jobs();
    let job = desired_job();
    jobs.apply(std::slice::from_ref(&job)).await;
    let id = f.container(&job);
    f.runtime.exit_job(&id, 0, b"done\n");
    converge(&mut jobs, &job).await;
    let log = jobs.log_path(job.job_id).unwrap();
    assert!(log.is_file());
    assert!(status(&mut jobs, &job).await.log.unwrap().complete);
    f.calls();
    jobs.apply(&[]).await;
    assert_eq!(f.calls(), [format!("remove {id}")]);
    assert!(f.runtime.jobs().is_empty());
    assert!(!log.exists(), "the log goes with the job");
    assert!(!jobs.record_path(job.job_id).unwrap().exists());
    assert!(
        f.dir
            .path()
            .join("jobs")
            .join(job.chain_id.to_string())
            .is_dir(),
        "the chain's directory stays"
    );
}

#[tokio::test]
async fn without_an_image_store_jobs_fail_saying_so() {
    let f = Fixture::new();
    let mut jobs = Jobs::new(
        f.runtime.clone(),
        NodeName::parse("node1").unwrap(),
        GpuAccess::EnvironmentOnly,
        NodeGuard {
            firewall: Arc::new(FakeFirewall::default()),
            subnet_pool: "10.213.0.0/16".parse().unwrap(),
            storage: Default::default(),
            ceiling: LimitCeiling::NONE,
        },
        None,
    );
    let job = desired_job();
    jobs.apply(std::slice::from_ref(&job)).await;
    assert!(f.runtime.jobs().is_empty());
    let ObservedJobStatus::Failed { error } = status(&mut jobs, &job).await.status else {
        panic!("no store, no job");
    };
    assert!(error.contains("[images] store"), "{error}");
}
