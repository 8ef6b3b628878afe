//! Batch jobs through the API: submit (image resolution, refusals), privacy between users, the
//! scheduler starting a job, agents' reports driving its states and output, a halt that
//! re-queues a restartable job as the next of its chain, and cancel.

use ongrid_core::image::{CreateImage, FreezeProgress, ImageReference};
use ongrid_core::job::{
    JobRun, JobSpecFile, JobState, JobView, LogChunk, ObservedJob, ObservedJobStatus, SubmitJob,
};

use super::*;

pub(super) fn submit(image: &str, restartable: bool) -> SubmitJob {
    let spec = JobSpecFile {
        image: Some(image.to_owned()),
        command: vec!["python".into(), "train.py".into()],
        restartable,
        max_duration: Some("2h".into()),
        ..JobSpecFile::default()
    }
    .validate(Utc::now())
    .unwrap();
    SubmitJob {
        spec,
        reservation: None,
    }
}

pub(super) async fn report(
    m: &Running,
    gpus: &[GpuInfo],
    freezes: Vec<FreezeProgress>,
    jobs: Vec<ObservedJob>,
) -> DesiredState {
    let body = NodeReport {
        node: NodeName::parse("node1").unwrap(),
        gpus: gpus.to_vec(),
        containers: Vec::new(),
        activity: Vec::new(),
        freezes,
        jobs,
    };
    m.node1
        .ok(StatusCode::OK, m.node1.post("/v1/agent/sync", &body))
        .await
}

impl Api {
    pub(super) async fn job(&self, id: &str) -> JobView {
        self.ok(StatusCode::OK, self.get(&format!("/v1/jobs/{id}")))
            .await
    }

    /// Waits until the job reaches `state` (the scheduler runs in its own task).
    pub(super) async fn wait_for_job(&self, id: &str, state: JobState) -> JobView {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        loop {
            let view = self.job(id).await;
            if view.state == state {
                return view;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "job {id} is still {} ({}), not {state}",
                view.state,
                view.reason
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Alice's READY image `mymodel:v1`, frozen from a session that is then removed. Its digest.
pub(super) async fn frozen_image(m: &Running, gpus: &[GpuInfo]) -> String {
    let session = m.alice.create(Some("train1"), one_gpu()).await;
    m.alice.wait_for("train1", SessionState::Starting).await;
    let running = vec![container(&session, ContainerState::Running, None)];
    m.node1.sync("node1", gpus.to_vec(), running).await;
    m.alice.wait_for("train1", SessionState::Waiting).await;
    let freeze = CreateImage {
        session: SessionName::parse("train1").unwrap(),
        reference: ImageReference::parse("mymodel:v1").unwrap(),
        force: false,
        compression: Default::default(),
    };
    let image: ongrid_core::image::ImageView = m
        .alice
        .ok(StatusCode::CREATED, m.alice.post("/v1/images", &freeze))
        .await;
    let digest = format!("sha256:{}", "cd".repeat(32));
    let done = FreezeProgress::Done {
        image_id: image.id,
        digest: digest.clone(),
        size: 3,
        sif_path: "/store/sha256/cd.sif".to_owned(),
        docker_image: "ongrid/alice-smith/mymodel:v1".to_owned(),
    };
    report(m, gpus, vec![done], vec![]).await;
    let _: SessionView = m
        .alice
        .ok(StatusCode::OK, m.alice.delete("/v1/sessions/train1"))
        .await;
    digest
}

pub(super) fn exited(code: i32, killed: bool) -> ObservedJobStatus {
    ObservedJobStatus::Exited {
        started_at: Utc::now(),
        finished_at: Utc::now(),
        exit_code: code,
        oom_killed: false,
        killed,
        signalled_at: None,
    }
}

#[tokio::test]
async fn jobs_run_report_halt_restart_and_stay_private() {
    let site = Site::new();
    let m = site.start().await;
    let gpus = vec![a100(1)];
    m.node1.register("node1", gpus.clone()).await;
    // Alice's image by her login and by its digest (the one `frozen_image` makes), asked by Bob
    // before it exists and once it exists, private: the same answers, status and words.
    let others = [
        "alice-smith/mymodel:v1".to_owned(),
        format!("sha256:{}", "cd".repeat(32)),
    ];
    let mut before = Vec::new();
    for image in &others {
        before.push(
            m.bob
                .send(m.bob.post("/v1/jobs", &submit(image, false)))
                .await,
        );
    }
    let digest = frozen_image(&m, &gpus).await;
    assert_eq!(digest, others[1]);
    for (image, before) in others.iter().zip(before) {
        let after = m
            .bob
            .send(m.bob.post("/v1/jobs", &submit(image, false)))
            .await;
        assert_eq!(after, before, "{image}: private and missing answer alike");
        assert_eq!(after.0, StatusCode::FORBIDDEN, "{image}: {}", after.1);
        assert!(
            message(&after.1).contains(&format!(
                "there is no frozen image {image} that you may run"
            )),
            "{image}: {}",
            after.1
        );
    }

    // Unknown and others' images are refused.
    let unknown = m
        .alice
        .fails(
            StatusCode::FORBIDDEN,
            m.alice.post("/v1/jobs", &submit("nothing:v1", false)),
        )
        .await;
    assert!(
        unknown.error.message.contains("devctl image ls"),
        "{unknown:?}"
    );
    let by_tag = m
        .bob
        .fails(
            StatusCode::FORBIDDEN,
            m.bob.post("/v1/jobs", &submit("mymodel:v1", false)),
        )
        .await;
    assert!(
        by_tag
            .error
            .message
            .contains("no frozen image mymodel:v1 that you may run"),
        "{by_tag:?}"
    );

    // Submitted, then started by the scheduler on the free GPU.
    let job: JobView = m
        .alice
        .ok(
            StatusCode::CREATED,
            m.alice.post("/v1/jobs", &submit("mymodel:v1", true)),
        )
        .await;
    assert_eq!(job.image_digest.as_deref(), Some(digest.as_str()));
    assert_eq!(job.chain.restart_count, 0);
    let id = job.id.to_string();
    let running = m.alice.wait_for_job(&id, JobState::Running).await;
    assert_eq!(running.node.as_ref().map(|n| n.as_str()), Some("node1"));
    assert_eq!(running.gpus, vec![GpuId::Gpu(a100(1).uuid)]);

    // Bob sees nothing of it and can change nothing.
    let listed: Vec<JobView> = m.bob.ok(StatusCode::OK, m.bob.get("/v1/jobs")).await;
    assert!(listed.is_empty());
    m.bob
        .fails(StatusCode::NOT_FOUND, m.bob.get(&format!("/v1/jobs/{id}")))
        .await;
    m.bob
        .fails(
            StatusCode::NOT_FOUND,
            m.bob.post(&format!("/v1/jobs/{id}/cancel"), &()),
        )
        .await;
    m.bob
        .fails(
            StatusCode::NOT_FOUND,
            m.bob.get(&format!("/v1/jobs/{id}/logs")),
        )
        .await;
    m.bob
        .fails(StatusCode::FORBIDDEN, m.bob.get("/v1/jobs?all=true"))
        .await;
    let all: Vec<JobView> = m
        .admin
        .ok(StatusCode::OK, m.admin.get("/v1/jobs?all=true"))
        .await;
    assert_eq!(all.len(), 1);

    // The node is told to run it, with the chain's variables.
    let desired = report(&m, &gpus, vec![], vec![]).await;
    assert_eq!(desired.jobs.len(), 1);
    let wanted = &desired.jobs[0];
    assert_eq!(wanted.run, JobRun::Run);
    assert_eq!(wanted.image.docker_image, "ongrid/alice-smith/mymodel:v1");
    assert_eq!(wanted.env["ONGRID_JOB_ID"], id);
    assert_eq!(wanted.env["ONGRID_RESTART_COUNT"], "0");
    assert_eq!(wanted.log_offset, 0);

    // Output comes in order; a repeated chunk is ignored.
    let output = |offset: u64, data: &[u8], complete: bool| LogChunk {
        offset,
        data: data.to_vec(),
        complete,
    };
    let running_status = ObservedJobStatus::Running {
        started_at: Utc::now(),
    };
    let chunks = [
        (output(0, b"epoch 1\n", false), 8),
        (output(0, b"epoch 1\n", false), 8),
        (output(8, b"epoch 2\n", false), 16),
    ];
    for (chunk, offset) in chunks {
        let desired = report(
            &m,
            &gpus,
            vec![],
            vec![ObservedJob {
                job_id: job.id,
                status: running_status.clone(),
                log: Some(chunk),
            }],
        )
        .await;
        assert_eq!(desired.jobs[0].log_offset, offset);
    }
    let logs: LogChunk = m
        .alice
        .ok(StatusCode::OK, m.alice.get(&format!("/v1/jobs/{id}/logs")))
        .await;
    assert_eq!(
        (logs.data.as_slice(), logs.complete),
        (&b"epoch 1\nepoch 2\n"[..], false)
    );
    let tail: LogChunk = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice.get(&format!("/v1/jobs/{id}/logs?offset=8")),
        )
        .await;
    assert_eq!(tail.data, b"epoch 2\n");

    // The owner halts it: MUSTHALT, the agent signals (HALTING) and it exits 123: HALTED, and
    // the restartable chain goes on as a new QUEUED job.
    let halted: JobView = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice.post(&format!("/v1/jobs/{id}/halt"), &()),
        )
        .await;
    assert_eq!(halted.state, JobState::MustHalt);
    let desired = report(&m, &gpus, vec![], vec![]).await;
    assert!(
        matches!(desired.jobs[0].run, JobRun::Halt { .. }),
        "{:?}",
        desired.jobs[0].run
    );
    let signalled = ObservedJobStatus::Halting {
        started_at: Utc::now(),
        signalled_at: Utc::now(),
    };
    report(
        &m,
        &gpus,
        vec![],
        vec![ObservedJob {
            job_id: job.id,
            status: signalled,
            log: None,
        }],
    )
    .await;
    assert_eq!(m.alice.job(&id).await.state, JobState::Halting);
    let last = output(16, b"checkpoint written\n", true);
    report(
        &m,
        &gpus,
        vec![],
        vec![ObservedJob {
            job_id: job.id,
            status: exited(123, false),
            log: Some(last),
        }],
    )
    .await;
    let done = m.alice.job(&id).await;
    assert_eq!(done.state, JobState::Halted);
    assert_eq!(done.exit_code, Some(123));
    assert_eq!(done.reason, "exited with code 123 after SIGUSR1");
    let next_id = done
        .next_job
        .expect("a restartable job is re-queued")
        .to_string();
    let logs: LogChunk = m
        .alice
        .ok(StatusCode::OK, m.alice.get(&format!("/v1/jobs/{id}/logs")))
        .await;
    assert!(logs.complete);
    assert!(logs.data.ends_with(b"checkpoint written\n"));

    // The next job of the chain runs on the GPU the first one left.
    let next = m.alice.wait_for_job(&next_id, JobState::Running).await;
    assert_eq!(next.previous_job, Some(job.id));
    assert_eq!(next.chain.initial_job, job.id);
    assert_eq!(next.chain.restart_count, 1);
    let desired = report(&m, &gpus, vec![], vec![]).await;
    let wanted = desired
        .jobs
        .iter()
        .find(|j| j.job_id.to_string() == next_id)
        .unwrap();
    assert_eq!(wanted.env["ONGRID_RESTART_COUNT"], "1");
    assert_eq!(wanted.env["ONGRID_RESTART_INITIAL_JOB_ID"], id);
    assert_eq!(wanted.chain_id, job.id);

    // Cancelled by its owner: the node is told to kill it; a second cancel is refused.
    let cancelled: JobView = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice.post(&format!("/v1/jobs/{next_id}/cancel"), &()),
        )
        .await;
    assert_eq!(cancelled.state, JobState::Cancelled);
    let desired = report(&m, &gpus, vec![], vec![]).await;
    let wanted = desired
        .jobs
        .iter()
        .find(|j| j.job_id.to_string() == next_id)
        .unwrap();
    assert_eq!(wanted.run, JobRun::Kill);
    let again = m
        .alice
        .fails(
            StatusCode::CONFLICT,
            m.alice.post(&format!("/v1/jobs/{next_id}/cancel"), &()),
        )
        .await;
    assert!(
        again.error.message.contains("CANCELLED already"),
        "{again:?}"
    );
    // The killed container's last report ends its output; the job is no longer listed.
    let killed = ObservedJob {
        job_id: cancelled.id,
        status: exited(137, true),
        log: Some(output(0, b"", true)),
    };
    let desired = report(&m, &gpus, vec![], vec![killed]).await;
    assert!(desired.jobs.is_empty(), "{:?}", desired.jobs);
    assert_eq!(m.alice.job(&next_id).await.state, JobState::Cancelled);
    m.stop().await;
}

/// One sync's reports of several jobs are all followed: a job that exited within one sync of
/// its halt signal passes through HALTING at the signal's time before it is HALTED (and its
/// restartable chain goes on), another job's exit finishes it, and the last output of both is
/// kept.
#[tokio::test]
async fn one_sync_ends_several_jobs_each_through_its_own_states() {
    let site = Site::new();
    let m = site.start().await;
    let gpus = vec![a100(1), a100(2)];
    m.node1.register("node1", gpus.clone()).await;
    frozen_image(&m, &gpus).await;
    let halted: JobView = m
        .alice
        .ok(
            StatusCode::CREATED,
            m.alice.post("/v1/jobs", &submit("mymodel:v1", true)),
        )
        .await;
    let halted_id = halted.id.to_string();
    m.alice.wait_for_job(&halted_id, JobState::Running).await;
    let finished_id = running_job(&m, &gpus, b"step 1\n").await;
    let finished = m.alice.job(&finished_id).await;
    let asked: JobView = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice.post(&format!("/v1/jobs/{halted_id}/halt"), &()),
        )
        .await;
    assert_eq!(asked.state, JobState::MustHalt);

    let signalled_at = Utc::now();
    let quick_exit = ObservedJobStatus::Exited {
        started_at: signalled_at - TimeDelta::seconds(60),
        finished_at: signalled_at + TimeDelta::seconds(1),
        exit_code: 123,
        oom_killed: false,
        killed: false,
        signalled_at: Some(signalled_at),
    };
    let last = |offset: u64, data: &[u8]| LogChunk {
        offset,
        data: data.to_vec(),
        complete: true,
    };
    let reports = vec![
        ObservedJob {
            job_id: halted.id,
            status: quick_exit,
            log: Some(last(0, b"checkpoint written\n")),
        },
        ObservedJob {
            job_id: finished.id,
            status: exited(0, false),
            log: Some(last(7, b"done\n")),
        },
    ];
    report(&m, &gpus, vec![], reports).await;

    let halted = m.alice.job(&halted_id).await;
    let states: Vec<JobState> = halted.transitions.iter().map(|t| t.to).collect();
    use JobState::{Halted, Halting, MustHalt, Queued, Running};
    assert_eq!(states, [Queued, Running, MustHalt, Halting, Halted]);
    assert_eq!(halted.transitions[3].at, signalled_at);
    assert_eq!(halted.exit_code, Some(123));
    assert!(halted.output_complete);
    let next = halted.next_job.expect("a restartable job is re-queued");
    assert_eq!(
        m.alice.job(&next.to_string()).await.previous_job,
        Some(halted.id)
    );
    let finished = m.alice.job(&finished_id).await;
    assert_eq!(
        (finished.state, finished.exit_code, finished.output_complete),
        (JobState::Finished, Some(0), true)
    );
    let logs: LogChunk = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice.get(&format!("/v1/jobs/{finished_id}/logs")),
        )
        .await;
    assert_eq!(
        (logs.data.as_slice(), logs.complete),
        (&b"step 1\ndone\n"[..], true)
    );
    m.stop().await;
}

/// Far shorter than the logs long-poll's timeout (60 s) and any periodic interval here (an hour
/// between syncs and scheduling rounds; no agent runs): only the manager's push answers within it.
const PUSHED_WITHIN: Duration = Duration::from_secs(5);

/// `GET /v1/jobs/{id}/logs?offset=N&wait=true&timeout=S`, in its own task.
fn logs_wait(api: &Api, id: &str, offset: u64, timeout: u64) -> JoinHandle<LogChunk> {
    let request = api
        .get(&format!(
            "/v1/jobs/{id}/logs?offset={offset}&wait=true&timeout={timeout}"
        ))
        .timeout(Duration::from_secs(timeout + 30));
    tokio::spawn(async move {
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        response.json().await.unwrap()
    })
}

#[tokio::test]
async fn a_logs_wait_is_answered_by_the_agents_output_and_the_jobs_end_only() {
    let site = Site::new();
    let mut config = site.config.clone();
    config.sync_interval = Duration::from_secs(3600);
    config.job_limits.output_grace = Duration::from_secs(2);
    let m = site.start_with(config, None).await;
    let gpus = vec![a100(1)];
    m.node1.register("node1", gpus.clone()).await;
    frozen_image(&m, &gpus).await;
    let job: JobView = m
        .alice
        .ok(
            StatusCode::CREATED,
            m.alice.post("/v1/jobs", &submit("mymodel:v1", false)),
        )
        .await;
    let id = job.id.to_string();
    m.alice.wait_for_job(&id, JobState::Running).await;
    let running = |log: Option<LogChunk>| ObservedJob {
        job_id: job.id,
        status: ObservedJobStatus::Running {
            started_at: Utc::now(),
        },
        log,
    };
    let output = |offset: u64, data: &[u8], complete: bool| LogChunk {
        offset,
        data: data.to_vec(),
        complete,
    };

    // No output: the wait takes its whole timeout and answers nothing, not complete.
    let started = tokio::time::Instant::now();
    let empty = logs_wait(&m.alice, &id, 0, 1).await.unwrap();
    assert!(started.elapsed() >= Duration::from_secs(1), "it waited");
    assert_eq!((empty.data.len(), empty.complete), (0, false));

    // The agent's report of output answers it.
    let waiting = logs_wait(&m.alice, &id, 0, 60);
    report(
        &m,
        &gpus,
        vec![],
        vec![running(Some(output(0, b"epoch 1\n", false)))],
    )
    .await;
    let chunk = tokio::time::timeout(PUSHED_WITHIN, waiting)
        .await
        .expect("the agent's output answered the wait")
        .unwrap();
    assert_eq!(
        (chunk.offset, chunk.data.as_slice()),
        (0, &b"epoch 1\n"[..])
    );
    assert!(!chunk.complete);

    // A sync without new output (it notifies) does not answer a wait past the end.
    let started = tokio::time::Instant::now();
    let waiting = logs_wait(&m.alice, &id, 8, 2);
    report(&m, &gpus, vec![], vec![running(None)]).await;
    let chunk = waiting.await.unwrap();
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "answered without output after {:?}",
        started.elapsed()
    );
    assert_eq!((chunk.data.len(), chunk.complete), (0, false));

    // A chunk from an older offset (a desired state the agent got late) adds only what is new.
    report(
        &m,
        &gpus,
        vec![],
        vec![running(Some(output(0, b"epoch 1\nepoch 2\n", false)))],
    )
    .await;
    let stored: LogChunk = m
        .alice
        .ok(StatusCode::OK, m.alice.get(&format!("/v1/jobs/{id}/logs")))
        .await;
    assert_eq!(stored.data, b"epoch 1\nepoch 2\n");
    assert!(!m.alice.job(&id).await.output_complete);

    // The job's end with its last output answers it, complete.
    let waiting = logs_wait(&m.alice, &id, 16, 60);
    let last = ObservedJob {
        job_id: job.id,
        status: exited(0, false),
        log: Some(output(16, b"done\n", true)),
    };
    report(&m, &gpus, vec![], vec![last]).await;
    let chunk = tokio::time::timeout(PUSHED_WITHIN, waiting)
        .await
        .expect("the agent's report of the end answered the wait")
        .unwrap();
    // The output is kept before the job's end is: the answer may come between the two, and
    // then says complete on the next wait.
    assert_eq!(chunk.data, b"done\n");
    let end = tokio::time::timeout(PUSHED_WITHIN, logs_wait(&m.alice, &id, 21, 60))
        .await
        .expect("complete output is answered at once")
        .unwrap();
    assert_eq!((end.data.len(), end.complete), (0, true));
    let finished = m.alice.job(&id).await;
    assert_eq!(finished.state, JobState::Finished);
    assert!(
        finished.output_complete,
        "the node said its output is all in"
    );

    // A job its owner cancels ends with no word from the agent: its output counts as complete
    // when the output grace (2 s here) has passed, and the wait answers then, not before.
    let second: JobView = m
        .alice
        .ok(
            StatusCode::CREATED,
            m.alice.post("/v1/jobs", &submit("mymodel:v1", false)),
        )
        .await;
    let second_id = second.id.to_string();
    m.alice.wait_for_job(&second_id, JobState::Running).await;
    let waiting = logs_wait(&m.alice, &second_id, 0, 60);
    let cancelled_at = tokio::time::Instant::now();
    let cancelled: JobView = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice.post(&format!("/v1/jobs/{second_id}/cancel"), &()),
        )
        .await;
    assert_eq!(cancelled.state, JobState::Cancelled);
    let chunk = tokio::time::timeout(Duration::from_secs(15), waiting)
        .await
        .expect("the end of the output grace answered the wait")
        .unwrap();
    assert!(
        cancelled_at.elapsed() >= Duration::from_millis(1500),
        "answered before the output grace passed: {:?}",
        cancelled_at.elapsed()
    );
    assert_eq!((chunk.data.len(), chunk.complete), (0, true));
    assert!(!m.alice.job(&second_id).await.output_complete);

    // Output that comes after the grace is still kept, not lost.
    let late = ObservedJob {
        job_id: second.id,
        status: exited(137, true),
        log: Some(output(0, b"late\n", true)),
    };
    report(&m, &gpus, vec![], vec![late]).await;
    let kept: LogChunk = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice.get(&format!("/v1/jobs/{second_id}/logs")),
        )
        .await;
    assert_eq!(
        (kept.data.as_slice(), kept.complete),
        (&b"late\n"[..], true)
    );
    assert!(m.alice.job(&second_id).await.output_complete);

    // Bob waits on nothing of Alice's.
    m.bob
        .fails(
            StatusCode::NOT_FOUND,
            m.bob
                .get(&format!("/v1/jobs/{id}/logs?wait=true&timeout=60")),
        )
        .await;
    m.stop().await;
}

/// A site that sets no `[jobs] max_duration` still caps jobs (two weeks): a job asking for
/// 2^64-1 seconds is refused with the cap and how to ask for less; one asking for the cap
/// itself passes that check (and is refused only for its image, which does not exist).
#[tokio::test]
async fn a_job_longer_than_the_sites_cap_is_refused_naming_it() {
    let site = Site::new();
    let m = site.start().await;
    let mut body = serde_json::to_value(submit("mymodel:v1", false)).unwrap();
    body["spec"]["max_duration"] = serde_json::Value::from(u64::MAX);
    let refused = m
        .alice
        .fails(StatusCode::BAD_REQUEST, m.alice.post("/v1/jobs", &body))
        .await;
    assert_eq!(
        refused.error.message,
        "max duration 30500568904943 weeks (18446744073709551615 seconds) is more than \
         this site allows (2 weeks): ask for 2 weeks or less (--max-duration of devctl job \
         submit, max_duration in a job file)"
    );
    body["spec"]["max_duration"] = serde_json::Value::from(14 * 86_400u64);
    let (status, text) = m.alice.send(m.alice.post("/v1/jobs", &body)).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{text}");
    assert!(message(&text).contains("no frozen image"), "{text}");
    let jobs: Vec<JobView> = m.alice.ok(StatusCode::OK, m.alice.get("/v1/jobs")).await;
    assert!(jobs.is_empty(), "{jobs:?}");
    m.stop().await;
}

/// Alice's job of `mymodel:v1`, started by the scheduler and with `output` sent by its node.
async fn running_job(m: &Running, gpus: &[GpuInfo], output: &[u8]) -> String {
    let job: JobView = m
        .alice
        .ok(
            StatusCode::CREATED,
            m.alice.post("/v1/jobs", &submit("mymodel:v1", false)),
        )
        .await;
    let id = job.id.to_string();
    m.alice.wait_for_job(&id, JobState::Running).await;
    let running = ObservedJob {
        job_id: job.id,
        status: ObservedJobStatus::Running {
            started_at: Utc::now(),
        },
        log: Some(LogChunk {
            offset: 0,
            data: output.to_vec(),
            complete: false,
        }),
    };
    let desired = report(m, gpus, vec![], vec![running]).await;
    assert!(desired.jobs.iter().any(|j| j.job_id == job.id));
    id
}

/// `DELETE /v1/jobs/{id}` (`devctl job rm`): the owner's ended job goes with its output file
/// (an admin's: anyone's); a job that has not ended, or whose output is still coming in, is
/// refused saying what to do; someone else's job answers the 404 of a missing one. Jobs ended
/// longer ago than `[retention] jobs` are pruned by the manager itself.
#[tokio::test]
async fn ended_jobs_are_removed_with_their_output_and_pruned_past_the_retention() {
    let site = Site::new();
    let clock = Arc::new(ManualClock::new(Utc::now()));
    let m = site
        .start_with(site.config.clone(), Some(clock.clone()))
        .await;
    let gpus = vec![a100(1)];
    m.node1.register("node1", gpus.clone()).await;
    frozen_image(&m, &gpus).await;
    let output_file = |id: &str| site.dir.path().join("jobs").join(format!("{id}.log"));

    let id = running_job(&m, &gpus, b"epoch 1\n").await;
    let path = format!("/v1/jobs/{id}");
    assert_eq!(std::fs::read(output_file(&id)).unwrap(), b"epoch 1\n");
    // Bob gets the answer of a job that does not exist, to the letter but the id.
    let missing = ongrid_core::job::JobId::new_random().to_string();
    let theirs = m
        .bob
        .fails(StatusCode::NOT_FOUND, m.bob.delete(&path))
        .await;
    let none = m
        .bob
        .fails(
            StatusCode::NOT_FOUND,
            m.bob.delete(&format!("/v1/jobs/{missing}")),
        )
        .await;
    assert_eq!(
        theirs.error.message.replace(&id, "ID"),
        none.error.message.replace(&missing, "ID")
    );
    let running = m
        .alice
        .fails(StatusCode::CONFLICT, m.alice.delete(&path))
        .await;
    assert_eq!(
        running.error.message,
        format!(
            "job {id} is RUNNING and has not ended: cancel it first with `devctl job cancel \
             {id}`, then remove it"
        )
    );
    // Cancelled, while its node may still send output: not yet.
    let cancelled: JobView = m
        .alice
        .ok(StatusCode::OK, m.alice.post(&format!("{path}/cancel"), &()))
        .await;
    let coming = m
        .alice
        .fails(StatusCode::CONFLICT, m.alice.delete(&path))
        .await;
    assert!(
        coming.error.message.starts_with(&format!(
            "the output of job {id} is still coming in from node1: remove it after "
        )),
        "{coming:?}"
    );
    // The node's last report ends its output: removed, with its file.
    let killed = ObservedJob {
        job_id: cancelled.id,
        status: exited(137, true),
        log: Some(LogChunk {
            offset: 8,
            data: Vec::new(),
            complete: true,
        }),
    };
    report(&m, &gpus, vec![], vec![killed]).await;
    let removed: JobView = m.alice.ok(StatusCode::OK, m.alice.delete(&path)).await;
    assert_eq!(
        (removed.id, removed.state),
        (cancelled.id, JobState::Cancelled)
    );
    assert!(!output_file(&id).exists());
    m.alice
        .fails(StatusCode::NOT_FOUND, m.alice.get(&path))
        .await;
    m.alice
        .fails(StatusCode::NOT_FOUND, m.alice.delete(&path))
        .await;
    let listed: Vec<JobView> = m.alice.ok(StatusCode::OK, m.alice.get("/v1/jobs")).await;
    assert!(listed.is_empty(), "{listed:?}");

    // An admin removes anyone's ended job, here once the output grace passed.
    let second = running_job(&m, &gpus, b"epoch 1\n").await;
    let _: JobView = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice.post(&format!("/v1/jobs/{second}/cancel"), &()),
        )
        .await;
    clock.advance(TimeDelta::minutes(11));
    let removed: JobView = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin.delete(&format!("/v1/jobs/{second}")),
        )
        .await;
    assert_eq!(removed.state, JobState::Cancelled);
    assert!(!output_file(&second).exists());

    // One ended now is pruned, with its output, by a manager that starts 31 days later.
    let third = running_job(&m, &gpus, b"epoch 1\n").await;
    let _: JobView = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice.post(&format!("/v1/jobs/{third}/cancel"), &()),
        )
        .await;
    let fourth = running_job(&m, &gpus, b"epoch 1\n").await;
    m.stop().await;
    assert!(output_file(&third).exists());
    clock.advance(TimeDelta::days(31));
    let m = site
        .start_with(site.config.clone(), Some(clock.clone()))
        .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let (status, body) = m
            .alice
            .send(m.alice.get(&format!("/v1/jobs/{third}")))
            .await;
        // The record goes first, then its output file: both gone.
        let file = output_file(&third).exists();
        if status == StatusCode::NOT_FOUND && !file {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "job {third} was not pruned with its output: {status} {body}, output file left: {file}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A job that had not ended is kept however old it is (the restarted manager halts it at its
    // max duration or fails it with its silent node, and it ended only now).
    let kept = m.alice.job(&fourth).await;
    assert_eq!(kept.id.to_string(), fourth);
    assert!(output_file(&fourth).exists());
    m.stop().await;
}

/// A local job no GPU of the site could ever run is refused at once, as a session is, with the
/// requirement that fails, what the site has and where to look; it used to be queued for ever.
/// One the site can run is queued as before.
#[tokio::test]
async fn a_local_job_no_gpu_of_the_site_can_run_is_refused_at_once() {
    let site = Site::new();
    let m = site.start().await;
    let gpus = vec![a100(1)];
    m.node1.register("node1", gpus.clone()).await;
    frozen_image(&m, &gpus).await;
    let asking = |gpus: u32, capability: &str, memory: &str| {
        let spec = JobSpecFile {
            image: Some("mymodel:v1".to_owned()),
            command: vec!["python".into(), "train.py".into()],
            gpus: Some(gpus),
            min_capability: Some(capability.to_owned()),
            min_gpu_memory: Some(memory.to_owned()),
            ..JobSpecFile::default()
        }
        .validate(Utc::now())
        .unwrap();
        SubmitJob {
            spec,
            reservation: None,
        }
    };
    for (body, why) in [
        (
            asking(1, "9.0", "1G"),
            "no GPU has compute capability 9.0 or more (the highest is 8.0)",
        ),
        (
            asking(2, "8.0", "1G"),
            "no node has 2 GPUs that meet the request (the most on one node is 1)",
        ),
    ] {
        let refused = m
            .alice
            .fails(
                StatusCode::UNPROCESSABLE_ENTITY,
                m.alice.post("/v1/jobs", &body),
            )
            .await;
        assert_eq!(refused.error.code, "unsatisfiable");
        assert_eq!(refused.error.message, format!("{why}; see `devctl gpus`"));
    }
    let jobs: Vec<JobView> = m.alice.ok(StatusCode::OK, m.alice.get("/v1/jobs")).await;
    assert!(jobs.is_empty(), "nothing was queued: {jobs:?}");

    let fits: JobView = m
        .alice
        .ok(
            StatusCode::CREATED,
            m.alice.post("/v1/jobs", &asking(1, "8.0", "1G")),
        )
        .await;
    assert_eq!(fits.spec.gpus.count, 1);
    m.stop().await;
}

/// A job submitted again with the same `Idempotency-Key` answers with the first one's job, one
/// job queued; without the key it is another job.
#[tokio::test]
async fn a_job_submitted_again_with_its_idempotency_key_is_queued_once() {
    let site = Site::new();
    let m = site.start().await;
    let gpus = vec![a100(1)];
    m.node1.register("node1", gpus.clone()).await;
    frozen_image(&m, &gpus).await;
    let body = submit("mymodel:v1", false);
    let send = || {
        m.alice
            .post("/v1/jobs", &body)
            .header("Idempotency-Key", "job-key-1")
    };
    let first: JobView = m.alice.ok(StatusCode::CREATED, send()).await;
    let again: JobView = m.alice.ok(StatusCode::CREATED, send()).await;
    assert_eq!(again.id, first.id);
    let jobs: Vec<JobView> = m.alice.ok(StatusCode::OK, m.alice.get("/v1/jobs")).await;
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    let other: JobView = m
        .alice
        .ok(StatusCode::CREATED, m.alice.post("/v1/jobs", &body))
        .await;
    assert_ne!(other.id, first.id);
    m.stop().await;
}
