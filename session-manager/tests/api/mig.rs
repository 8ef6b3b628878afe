//! MIG over the real API: an admin's layout checked against the GPU's model, sent to the
//! node's agent in its desired state; the devices the agent reports become places for sessions
//! that ask for a MIG device (least sufficient first, one session each), never for whole-GPU
//! requests; `GET /v1/nodes` shows which session holds which device.

use ongrid_core::api::SetGpuMode;
use ongrid_core::{GpuId, GpuMode, MigDevice, MigLayout, MigUuid, Sharing};

use super::*;

const A100_80: &str = "NVIDIA A100-SXM4-80GB";

fn a100_80() -> GpuInfo {
    GpuInfo {
        model: A100_80.to_owned(),
        memory: MemorySize::from_mib(81_920),
        ..a100(1)
    }
}

/// The GPU after its agent made `layout`: MIG mode on, one device per instance.
fn partitioned(layout: &str) -> GpuInfo {
    let gpu = a100_80();
    let layout: MigLayout = layout.parse().unwrap();
    let mig_devices = layout
        .instances()
        .into_iter()
        .enumerate()
        .map(|(i, profile)| MigDevice {
            uuid: MigUuid::parse(&format!("MIG-aaaaaaaa-bbbb-cccc-dddd-0000000000{i:02}")).unwrap(),
            profile,
            memory: profile.nominal_memory(),
            parent: gpu.uuid.clone(),
        })
        .collect();
    GpuInfo {
        mig_enabled: true,
        mig_devices,
        ..gpu
    }
}

fn mig(profile: &str) -> GpuRequest {
    GpuRequest {
        sharing: Sharing::Mig(profile.parse().unwrap()),
        ..GpuRequest::default()
    }
}

fn mode(text: &str) -> SetGpuMode {
    SetGpuMode {
        mode: text.parse().unwrap(),
    }
}

#[tokio::test]
async fn sessions_get_mig_devices_of_the_admins_layout() {
    let site = Site::new();
    let m = site.start().await;
    let gpu = a100_80();
    m.node1.register("node1", vec![gpu.clone()]).await;
    let path = format!("/v1/gpus/{}/mode", gpu.uuid);

    // Checked against the model's profiles.
    let refused = m
        .admin
        .fails(
            StatusCode::BAD_REQUEST,
            m.admin.put(&path, &mode("mig:1g.5gb*7")),
        )
        .await;
    assert_eq!(
        refused.error.message,
        format!(
            "mig:1g.5gb*7 on {}: A100-80GB has no MIG profile 1g.5gb; its profiles are 1g.10gb, \
             1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb",
            gpu.uuid
        )
    );
    let refused = m
        .admin
        .fails(
            StatusCode::BAD_REQUEST,
            m.admin.put(&path, &mode("mig:3g.40gb*3")),
        )
        .await;
    assert!(
        refused
            .error
            .message
            .contains("at most 2 instance(s) of 3g.40gb"),
        "{}",
        refused.error.message
    );
    let view: GpuView = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin.put(&path, &mode("mig:3g.40gb*1+2g.20gb*2")),
        )
        .await;
    assert_eq!(view.mode.to_string(), "mig:3g.40gb*1+2g.20gb*2");

    // The agent is told; until it reports devices, no session can get one, and a whole GPU is
    // never given out from a GPU in MIG mode.
    let desired = m.node1.sync("node1", vec![gpu.clone()], Vec::new()).await;
    assert_eq!(
        desired.mig_layouts.get(&gpu.uuid).map(ToString::to_string),
        Some("3g.40gb*1+2g.20gb*2".to_owned())
    );
    let early = m
        .alice
        .fails(
            StatusCode::UNPROCESSABLE_ENTITY,
            m.alice.post(
                "/v1/sessions",
                &CreateSession {
                    name: None,
                    gpus: mig("1g.10gb"),
                    image: None,
                    idle_timeout_secs: None,
                    max_duration_secs: None,
                    reservation: None,
                },
            ),
        )
        .await;
    assert!(
        early
            .error
            .message
            .starts_with("no MIG device on the site is 1g.10gb or larger (the site has: none)"),
        "{}",
        early.error.message
    );
    m.alice
        .fails(
            StatusCode::UNPROCESSABLE_ENTITY,
            m.alice.post(
                "/v1/sessions",
                &CreateSession {
                    name: None,
                    gpus: one_gpu(),
                    image: None,
                    idle_timeout_secs: None,
                    max_duration_secs: None,
                    reservation: None,
                },
            ),
        )
        .await;

    // The agent made the layout: sessions get its devices, smallest sufficient first.
    let gpu = partitioned("3g.40gb*1+2g.20gb*2");
    m.node1.register("node1", vec![gpu.clone()]).await;
    m.alice.create(Some("small"), mig("1g.10gb")).await;
    let small = m.alice.wait_for("small", SessionState::Starting).await;
    let two_g: Vec<GpuId> = gpu.mig_devices[1..]
        .iter()
        .map(|d| GpuId::Mig(d.uuid.clone()))
        .collect();
    assert_eq!(small.gpus.len(), 1);
    assert!(
        two_g.contains(&small.gpus[0]),
        "{:?} is not a 2g device",
        small.gpus
    );
    assert!(small.reason.contains("MIG device"), "{}", small.reason);
    m.alice.create(Some("big"), mig("3g.40gb")).await;
    let big = m.alice.wait_for("big", SessionState::Starting).await;
    assert_eq!(big.gpus, [GpuId::Mig(gpu.mig_devices[0].uuid.clone())]);
    m.alice.create(Some("other"), mig("2g.20gb")).await;
    let other = m.alice.wait_for("other", SessionState::Starting).await;
    assert_ne!(other.gpus, small.gpus, "two sessions on one MIG device");
    // All three devices are taken: the next one waits.
    let last = m.alice.create(Some("last"), mig("1g.10gb")).await;
    assert_eq!(last.state, SessionState::Pending);

    // The node's desired state carries the MIG UUID as the session's device.
    let desired = m.node1.sync("node1", vec![gpu.clone()], Vec::new()).await;
    let on_node: Vec<&GpuId> = desired.sessions.iter().flat_map(|s| &s.gpus).collect();
    assert_eq!(on_node.len(), 3);
    assert!(on_node.iter().all(|id| matches!(id, GpuId::Mig(_))));

    let nodes: Vec<NodeView> = m.admin.ok(StatusCode::OK, m.admin.get("/v1/nodes")).await;
    let view = &nodes[0].gpus[0];
    assert!(matches!(view.mode, GpuMode::Mig { .. }));
    assert_eq!((view.used, view.free), (3, 0));
    assert_eq!(view.mig_sessions.len(), 3);
    assert_eq!(
        view.mig_sessions
            .get(&gpu.mig_devices[0].uuid)
            .map(|s| s.as_str()),
        Some("big")
    );
}

#[tokio::test]
async fn a_queued_session_says_when_drained_gpus_are_why_it_waits() {
    let site = Site::new();
    let m = site.start().await;
    m.node1.register("node1", vec![a100(1)]).await;
    let drain = ongrid_core::api::DrainRequest {
        reason: Some("fan noise".to_owned()),
    };
    let _: GpuView = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin
                .post(&format!("/v1/gpus/{}/drain", a100(1).uuid), &drain),
        )
        .await;
    let queued = m.alice.create(Some("queued"), one_gpu()).await;
    assert_eq!(queued.state, SessionState::Pending);
    let expected = format!(
        "waits: GPUs that fit it are out of service (1 fit in all): {} on node1 drained ",
        a100(1).uuid
    );
    assert!(queued.reason.contains(&expected), "{}", queued.reason);
    assert!(queued.reason.ends_with(": fan noise"), "{}", queued.reason);
    let shown = m.alice.show("queued").await;
    assert!(shown.reason.contains(&expected), "{}", shown.reason);
}

/// A job of alice's frozen `mymodel:v1` on one MIG device of at least `profile`.
fn mig_job(profile: &str) -> ongrid_core::job::SubmitJob {
    let spec = ongrid_core::job::JobSpecFile {
        image: Some("mymodel:v1".to_owned()),
        command: vec!["python".into(), "train.py".into()],
        share: Some(format!("mig:{profile}")),
        max_duration: Some("2h".into()),
        ..Default::default()
    }
    .validate(Utc::now())
    .unwrap();
    ongrid_core::job::SubmitJob {
        spec,
        reservation: None,
    }
}

/// Waits until the job runs and reads it again: the store reads a job's row and its
/// transitions in two queries, so the read that first sees RUNNING may show the row of before.
async fn running(m: &Running, id: &str) -> ongrid_core::job::JobView {
    m.alice
        .wait_for_job(id, ongrid_core::job::JobState::Running)
        .await;
    m.alice.job(id).await
}

async fn submit_job(m: &Running, job: &ongrid_core::job::SubmitJob) -> String {
    let view: ongrid_core::job::JobView = m
        .alice
        .ok(StatusCode::CREATED, m.alice.post("/v1/jobs", job))
        .await;
    view.id.to_string()
}

#[tokio::test]
async fn batch_jobs_run_on_mig_devices_and_a_session_halts_one_for_its_device() {
    use ongrid_core::job::{JobRun, JobState, ObservedJob, ObservedJobStatus};

    use super::jobs::{exited, frozen_image, report};

    let site = Site::new();
    let m = site.start().await;
    let whole = a100(2);
    m.node1
        .register("node1", vec![a100_80(), whole.clone()])
        .await;
    let path = format!("/v1/gpus/{}/mode", a100_80().uuid);
    let _: GpuView = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin.put(&path, &mode("mig:3g.40gb*1+2g.20gb*2")),
        )
        .await;
    let gpu = partitioned("3g.40gb*1+2g.20gb*2");
    let gpus = vec![gpu.clone(), whole.clone()];
    m.node1.register("node1", gpus.clone()).await;
    frozen_image(&m, &gpus).await;
    let device = |i: usize| GpuId::Mig(gpu.mig_devices[i].uuid.clone());

    // A 1g job takes the least sufficient free device (a 2g one), a 3g job the 3g device, a
    // whole-GPU job the whole GPU, never the GPU in MIG mode.
    let first = submit_job(&m, &mig_job("1g.10gb")).await;
    let first = running(&m, &first).await;
    assert_eq!(first.gpus, [device(1)], "{first:?}");
    assert!(
        first.reason.contains(gpu.mig_devices[1].uuid.as_str()),
        "{}",
        first.reason
    );
    let big = submit_job(&m, &mig_job("3g.40gb")).await;
    let big = running(&m, &big).await;
    assert_eq!(big.gpus, [device(0)]);
    let whole_job = submit_job(&m, &super::jobs::submit("mymodel:v1", false)).await;
    let whole_job = running(&m, &whole_job).await;
    assert_eq!(whole_job.gpus, [GpuId::Gpu(whole.uuid.clone())]);
    // Another 3g job waits: the only 3g device is taken, and it says so.
    let waiting = submit_job(&m, &mig_job("3g.40gb")).await;
    let waiting = m.alice.job(&waiting).await;
    assert_eq!(waiting.state, JobState::Queued);
    assert_eq!(
        waiting.waiting.as_deref(),
        Some("for a free MIG device of profile 3g.40gb or larger")
    );

    // The node is told to run the job with the MIG UUID as its device.
    let desired = report(&m, &gpus, vec![], vec![]).await;
    let on_slice = desired
        .jobs
        .iter()
        .find(|j| j.job_id == first.id)
        .expect("the job is in its node's desired state");
    assert_eq!(on_slice.gpus, [device(1)]);
    assert_eq!(on_slice.run, JobRun::Run);

    // A session asking for a 2g device finds none free: it halts the job on the 2g device
    // that is past its min duration (the one the first job holds); the other 2g device is free
    // and goes to it first, so submit a third job to take that one.
    let third = submit_job(&m, &mig_job("2g.20gb")).await;
    let third = running(&m, &third).await;
    assert_eq!(third.gpus, [device(2)]);
    let session = m.bob.create(Some("slice"), mig("2g.20gb")).await;
    assert_eq!(session.state, SessionState::Pending);
    let halted = m
        .alice
        .wait_for_job(&first.id.to_string(), JobState::MustHalt)
        .await;
    assert_eq!(
        halted.reason,
        "halted for an interactive session needing 1 GPU, a MIG 2g.20gb device or larger"
    );
    assert_eq!(
        m.alice.job(&third.id.to_string()).await.state,
        JobState::Running,
        "one halt frees what the session needs"
    );
    // Still pending while the job halts; once it is HALTED the session gets its device.
    assert_eq!(m.bob.show("slice").await.state, SessionState::Pending);
    report(
        &m,
        &gpus,
        vec![],
        vec![ObservedJob {
            job_id: first.id,
            status: ObservedJobStatus::Halting {
                started_at: Utc::now(),
                signalled_at: Utc::now(),
            },
            log: None,
        }],
    )
    .await;
    report(
        &m,
        &gpus,
        vec![],
        vec![ObservedJob {
            job_id: first.id,
            status: exited(123, false),
            log: None,
        }],
    )
    .await;
    assert_eq!(
        m.alice.job(&first.id.to_string()).await.state,
        JobState::Halted
    );
    let placed = m.bob.wait_for("slice", SessionState::Starting).await;
    assert_eq!(placed.gpus, [device(1)]);
    // The queued 3g job still waits: nothing is given twice.
    assert_eq!(
        m.alice.job(&waiting.id.to_string()).await.state,
        JobState::Queued
    );
}

#[tokio::test]
async fn a_job_on_a_mig_device_costs_the_devices_fraction_of_its_gpu_in_fair_share() {
    use ongrid_core::api::FairShareView;
    use ongrid_core::job::JobState;

    let site = Site::new();
    let text = format!(
        "{}\n[fairshare]\nhalf_life = \"1 day\"\ncost = {{ A100 = 2.0 }}\n",
        std::fs::read_to_string(&site.config.path).unwrap()
    );
    let config = Config::from_toml(&text, &site.config.path, |_| None).unwrap();
    let clock = Arc::new(ManualClock::new(Utc::now()));
    let m = site.start_with(config, Some(clock.clone())).await;
    m.node1.register("node1", vec![a100_80(), a100(2)]).await;
    let path = format!("/v1/gpus/{}/mode", a100_80().uuid);
    let _: GpuView = m
        .admin
        .ok(StatusCode::OK, m.admin.put(&path, &mode("mig:3g.40gb*2")))
        .await;
    let gpus = vec![partitioned("3g.40gb*2"), a100(2)];
    m.node1.register("node1", gpus.clone()).await;
    super::jobs::frozen_image(&m, &gpus).await;
    let job = submit_job(&m, &mig_job("3g.40gb")).await;
    m.alice.wait_for_job(&job, JobState::Running).await;

    // Half an hour on 3 of the A100's 7 compute slices, at weight 2: 3/7 of a GPU-hour.
    clock.advance(TimeDelta::minutes(30));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let expected = 2.0 * 3.0 / 7.0 * 0.5;
    loop {
        // A sync wakes the scheduler, whose round charges the accounts.
        super::jobs::report(&m, &gpus, vec![], vec![]).await;
        let share: FairShareView = m.alice.ok(StatusCode::OK, m.alice.get("/v1/share")).await;
        let usage = share
            .groups
            .iter()
            .find(|g| g.group == "default")
            .map_or(0.0, |g| g.usage);
        // (Decayed a little: half an hour of a day's half-life.)
        if (usage - expected).abs() < 0.02 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline && usage < expected,
            "usage {usage}, expected {expected}: {share:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    m.stop().await;
}

#[tokio::test]
async fn a_gpu_set_back_to_exclusive_leaves_mig_mode_before_it_is_given_out_whole() {
    use ongrid_core::MigChange;

    let site = Site::new();
    let m = site.start().await;
    m.node1.register("node1", vec![a100_80()]).await;
    let path = format!("/v1/gpus/{}/mode", a100_80().uuid);
    let _: GpuView = m
        .admin
        .ok(StatusCode::OK, m.admin.put(&path, &mode("mig:7g.80gb*1")))
        .await;
    let gpu = partitioned("7g.80gb*1");
    m.node1.register("node1", vec![gpu.clone()]).await;
    m.alice.create(Some("slice"), mig("1g.10gb")).await;
    m.alice.wait_for("slice", SessionState::Starting).await;

    // Back to exclusive: the agent is told to leave MIG mode, and while it still reports MIG
    // mode on (waiting for the session on the device to end), nobody gets the GPU whole.
    let view: GpuView = m
        .admin
        .ok(StatusCode::OK, m.admin.put(&path, &mode("exclusive")))
        .await;
    assert_eq!(view.mode, GpuMode::Exclusive);
    assert_eq!(view.free, 0, "{view:?}");
    let waiting = GpuInfo {
        mig_waiting: Some(MigChange::Off),
        ..gpu.clone()
    };
    let desired = m.node1.sync("node1", vec![waiting], Vec::new()).await;
    assert!(desired.mig_off.contains(&gpu.uuid), "{desired:?}");
    assert!(desired.mig_layouts.is_empty());
    let whole = m.bob.create(Some("whole"), one_gpu()).await;
    assert_eq!(whole.state, SessionState::Pending);
    let why = m.bob.show("whole").await.reason;
    assert!(
        why.contains(&format!(
            "{} on node1 is leaving MIG mode, once nothing uses its MIG devices",
            gpu.uuid
        )),
        "{why}"
    );
    // Its devices are no longer offered either: the site has none now.
    let late = m
        .bob
        .fails(
            StatusCode::UNPROCESSABLE_ENTITY,
            m.bob.post(
                "/v1/sessions",
                &CreateSession {
                    name: None,
                    gpus: mig("1g.10gb"),
                    image: None,
                    idle_timeout_secs: None,
                    max_duration_secs: None,
                    reservation: None,
                },
            ),
        )
        .await;
    assert!(
        late.error
            .message
            .starts_with("no MIG device on the site is 1g.10gb or larger (the site has: none)"),
        "{}",
        late.error.message
    );

    // `GET /v1/nodes` says the GPU waits to drain for MIG mode off.
    let nodes: Vec<NodeView> = m.admin.ok(StatusCode::OK, m.admin.get("/v1/nodes")).await;
    assert_eq!(nodes[0].gpus[0].info.mig_waiting, Some(MigChange::Off));

    // The session ends, the agent leaves MIG mode and reports a whole GPU: it is given out.
    let _: SessionView = m
        .alice
        .ok(StatusCode::OK, m.alice.delete("/v1/sessions/slice"))
        .await;
    m.node1.register("node1", vec![a100_80()]).await;
    let desired = m.node1.sync("node1", vec![a100_80()], Vec::new()).await;
    assert!(desired.mig_off.is_empty(), "{desired:?}");
    let placed = m.bob.wait_for("whole", SessionState::Starting).await;
    assert_eq!(placed.gpus, [GpuId::Gpu(gpu.uuid.clone())]);
}
