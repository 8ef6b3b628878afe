//! Owned GPUs and reservations over the API: the admin commands and their refusals, others'
//! sessions kept off an owned GPU with the owner named, a backfill job halted when the owners'
//! session arrives, and a reservation that refuses the wrong group and the wrong time, keeps a
//! job that would overlap it off its GPU and halts the job running there when it starts. Time
//! is the manager's injected clock, moved by the test.

use ongrid_core::job::{JobState, JobView, ObservedJob};
use ongrid_core::reservation::{
    NewReservation, OwnerView, ReservationStatus, ReservationView, SetOwner,
};

use super::jobs::{exited, frozen_image, report, submit};
use super::*;

/// The test site with Alice in group `atlas` and Bob in group `cms`.
fn two_groups(site: &Site) -> Config {
    let text = format!(
        "{}\n[policy]\nadmit = [\n{{ dn = \"{ALICE}\", group = \"atlas\" }},\n\
         {{ dn = \"{BOB}\", group = \"cms\" }},\n]\n",
        std::fs::read_to_string(&site.config.path).unwrap()
    );
    Config::from_toml(&text, &site.config.path, |_| None).unwrap()
}

fn owner(group: &str) -> SetOwner {
    SetOwner {
        group: group.to_owned(),
    }
}

#[tokio::test]
async fn owners_are_set_by_admins_and_others_sessions_wait_naming_the_owner() {
    let site = Site::new();
    let m = site.start_with(two_groups(&site), None).await;
    m.node1.register("node1", vec![a100(1)]).await;
    let gpu = a100(1).uuid;

    // Only admins; unknown GPUs and nodes, bad group names: refused with the fix.
    let refused = m
        .bob
        .fails(
            StatusCode::FORBIDDEN,
            m.bob.put(&format!("/v1/gpus/{gpu}/owner"), &owner("cms")),
        )
        .await;
    assert_eq!(
        refused.error.message,
        "only admins can give GPUs owners; admins are listed in the manager's config"
    );
    let unknown = m
        .admin
        .fails(
            StatusCode::NOT_FOUND,
            m.admin.put(
                "/v1/gpus/GPU-99999999-2222-3333-4444-555555555599/owner",
                &owner("cms"),
            ),
        )
        .await;
    assert!(unknown.error.message.contains("devctl gpus"), "{unknown:?}");
    let bad = m
        .admin
        .fails(
            StatusCode::BAD_REQUEST,
            m.admin.put("/v1/nodes/node1/owner", &owner("CMS!")),
        )
        .await;
    assert!(bad.error.message.contains("lower-case"), "{bad:?}");

    // The node is cms's; the GPU's own owner would win, and clearing it falls back to the node.
    let set: OwnerView = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin.put("/v1/nodes/node1/owner", &owner("cms")),
        )
        .await;
    assert_eq!(set.group.as_deref(), Some("cms"));
    let owners: Vec<OwnerView> = m.alice.ok(StatusCode::OK, m.alice.get("/v1/owners")).await;
    assert_eq!(owners, vec![set]);

    // Alice (atlas) waits, told whose GPU it is; Bob (cms) gets it.
    let alices = m.alice.create(Some("mine"), one_gpu()).await;
    assert_eq!(alices.state, SessionState::Pending);
    let shown = m.alice.show("mine").await;
    assert!(
        shown.reason.contains(
            "waits: 1 GPU that fit are owned by group cms, whose work goes first there (other \
             groups' sessions are not placed on them)"
        ),
        "{}",
        shown.reason
    );
    m.bob.create(Some("owners"), one_gpu()).await;
    m.bob.wait_for("owners", SessionState::Starting).await;
    assert_eq!(m.alice.show("mine").await.state, SessionState::Pending);

    // Cleared: Alice's session may take it once Bob's is gone.
    let cleared: OwnerView = m
        .admin
        .ok(StatusCode::OK, m.admin.delete("/v1/nodes/node1/owner"))
        .await;
    assert_eq!(cleared.group, None);
    let _: SessionView = m
        .bob
        .ok(StatusCode::OK, m.bob.delete("/v1/sessions/owners"))
        .await;
    m.alice.wait_for("mine", SessionState::Starting).await;
    m.stop().await;
}

/// Alice's (atlas) restartable job running on node1's only GPU (her image frozen before).
async fn running_job(m: &Running) -> JobView {
    let job: JobView = m
        .alice
        .ok(
            StatusCode::CREATED,
            m.alice.post("/v1/jobs", &submit("mymodel:v1", true)),
        )
        .await;
    m.alice
        .wait_for_job(&job.id.to_string(), JobState::Running)
        .await
}

#[tokio::test]
async fn a_backfill_job_is_halted_when_the_owners_session_arrives() {
    let site = Site::new();
    let m = site.start_with(two_groups(&site), None).await;
    let gpus = vec![a100(1)];
    m.node1.register("node1", gpus.clone()).await;
    let gpu = a100(1).uuid;
    frozen_image(&m, &gpus).await;
    let _: OwnerView = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin.put(&format!("/v1/gpus/{gpu}/owner"), &owner("cms")),
        )
        .await;

    // Atlas's job runs on cms's GPU as backfill.
    let job = running_job(&m).await;
    let id = job.id.to_string();
    assert_eq!(job.gpus, vec![GpuId::Gpu(gpu.clone())]);

    // Bob's (cms) session arrives: the job must halt, the session waits for that GPU.
    let session = m.bob.create(Some("owners"), one_gpu()).await;
    assert_eq!(session.state, SessionState::Pending);
    let halting = m.alice.wait_for_job(&id, JobState::MustHalt).await;
    assert_eq!(
        halting.reason,
        "halted: it ran as backfill on GPUs owned by group cms, whose work needed them"
    );
    assert_eq!(m.bob.show("owners").await.state, SessionState::Pending);

    // It exits 123 after SIGUSR1: HALTED, re-queued (restartable), and the session starts on
    // the GPU it left; the re-queued job waits.
    report(
        &m,
        &gpus,
        vec![],
        vec![ObservedJob {
            job_id: job.id,
            status: exited(123, false),
            log: None,
        }],
    )
    .await;
    let halted = m.alice.job(&id).await;
    assert_eq!(halted.state, JobState::Halted);
    let started = m.bob.wait_for("owners", SessionState::Starting).await;
    assert_eq!(started.gpus, vec![GpuId::Gpu(gpu)]);
    assert!(
        started.reason.ends_with("it preempted batch work"),
        "{}",
        started.reason
    );
    let next = m
        .alice
        .job(&halted.next_job.expect("re-queued").to_string())
        .await;
    assert_eq!(next.state, JobState::Queued);
    m.stop().await;
}

fn reservation(name: &str, from: DateTime<Utc>, to: DateTime<Utc>) -> NewReservation {
    NewReservation {
        name: name.to_owned(),
        group: "cms".to_owned(),
        gpus: vec![a100(1).uuid],
        node: None,
        from,
        to,
    }
}

#[tokio::test]
async fn a_reservation_refuses_others_and_halts_their_jobs_when_it_starts() {
    let site = Site::new();
    let t0 = Utc::now();
    let clock = Arc::new(ManualClock::new(t0));
    let m = site
        .start_with(two_groups(&site), Some(clock.clone()))
        .await;
    let gpus = vec![a100(1)];
    m.node1.register("node1", gpus.clone()).await;
    // Alice's job of at most 2 hours runs on the only GPU.
    frozen_image(&m, &gpus).await;
    let job = running_job(&m).await;
    let id = job.id.to_string();

    // The school: cms's, from 10 minutes from now for 2 hours.
    let (from, to) = (t0 + TimeDelta::minutes(10), t0 + TimeDelta::minutes(130));
    let refused = m
        .alice
        .fails(
            StatusCode::FORBIDDEN,
            m.alice
                .post("/v1/reservations", &reservation("school", from, to)),
        )
        .await;
    assert!(
        refused.error.message.starts_with("only admins"),
        "{refused:?}"
    );
    let added: ReservationView = m
        .admin
        .ok(
            StatusCode::CREATED,
            m.admin
                .post("/v1/reservations", &reservation("school", from, to)),
        )
        .await;
    assert_eq!(added.status, ReservationStatus::Upcoming);
    assert_eq!(added.gpus, vec![a100(1).uuid]);
    assert_eq!(added.created_by, "site-admin");
    // The same GPU twice at the same time, or a window backwards: refused, saying why.
    let clash = m
        .admin
        .fails(
            StatusCode::CONFLICT,
            m.admin.post(
                "/v1/reservations",
                &reservation(
                    "other",
                    to - TimeDelta::minutes(1),
                    to + TimeDelta::hours(1),
                ),
            ),
        )
        .await;
    assert!(
        clash
            .error
            .message
            .contains("is already reserved by school for group cms"),
        "{clash:?}"
    );
    let backwards = m
        .admin
        .fails(
            StatusCode::BAD_REQUEST,
            m.admin
                .post("/v1/reservations", &reservation("back", to, from)),
        )
        .await;
    assert!(
        backwards.error.message.contains("must be after"),
        "{backwards:?}"
    );
    let listed: Vec<ReservationView> = m
        .bob
        .ok(StatusCode::OK, m.bob.get("/v1/reservations"))
        .await;
    assert_eq!(listed, vec![added]);

    // Using it (named in the body; older clients name it in the query): not for another
    // group's user, not before its window.
    let body = CreateSession {
        name: Some(SessionName::parse("school").unwrap()),
        gpus: one_gpu(),
        image: None,
        idle_timeout_secs: None,
        max_duration_secs: Some(3600),
        reservation: Some("school".to_owned()),
    };
    let wrong_group = m
        .alice
        .fails(StatusCode::FORBIDDEN, m.alice.post("/v1/sessions", &body))
        .await;
    assert_eq!(
        wrong_group.error.message,
        "reservation school is for group cms, and you use the site in group atlas: ask the \
         site's admins to add you to cms or leave out --reservation"
    );
    let in_query = CreateSession {
        reservation: None,
        ..body.clone()
    };
    let too_early = m
        .bob
        .fails(
            StatusCode::CONFLICT,
            m.bob.post("/v1/sessions?reservation=school", &in_query),
        )
        .await;
    assert!(
        too_early
            .error
            .message
            .starts_with("reservation school starts at"),
        "{too_early:?}"
    );
    let nope = CreateSession {
        reservation: Some("nope".to_owned()),
        ..body.clone()
    };
    let unknown = m
        .bob
        .fails(StatusCode::BAD_REQUEST, m.bob.post("/v1/sessions", &nope))
        .await;
    assert!(
        unknown
            .error
            .message
            .contains("there is no reservation nope"),
        "{unknown:?}"
    );
    let both = m
        .bob
        .fails(
            StatusCode::BAD_REQUEST,
            m.bob.post("/v1/sessions?reservation=other", &body),
        )
        .await;
    assert_eq!(
        both.error.message,
        "the body names reservation \"school\" and the query \"other\": name one, in the \
         body's reservation field"
    );

    // Nine minutes on, Alice's job still runs; the window opens at ten: it is halted.
    clock.advance(TimeDelta::minutes(9));
    report(&m, &gpus, vec![], vec![]).await;
    assert_eq!(m.alice.job(&id).await.state, JobState::Running);
    clock.advance(TimeDelta::minutes(1));
    report(&m, &gpus, vec![], vec![]).await;
    let halting = m.alice.wait_for_job(&id, JobState::MustHalt).await;
    assert_eq!(
        halting.reason,
        "halted: reservation school of group cms started on its GPUs"
    );
    report(
        &m,
        &gpus,
        vec![],
        vec![ObservedJob {
            job_id: job.id,
            status: exited(123, false),
            log: None,
        }],
    )
    .await;
    let halted = m.alice.job(&id).await;
    assert_eq!(halted.state, JobState::Halted);

    // The re-queued job (2 hours at most) stays off the reserved GPU, saying why; Bob's session
    // in the reservation takes it.
    let next_id = halted.next_job.expect("re-queued").to_string();
    let waiting = m.alice.job(&next_id).await;
    assert_eq!(waiting.state, JobState::Queued);
    let why = waiting.waiting.unwrap_or_default();
    assert!(
        why.contains("1 GPU reserved for group cms by reservation school from"),
        "{why}"
    );
    let session: SessionView = m
        .bob
        .ok(StatusCode::CREATED, m.bob.post("/v1/sessions", &body))
        .await;
    assert_eq!(session.state, SessionState::Starting, "{}", session.reason);
    assert_eq!(session.gpus, vec![GpuId::Gpu(a100(1).uuid)]);

    // Removed: listed no more.
    let removed: ReservationView = m
        .admin
        .ok(StatusCode::OK, m.admin.delete("/v1/reservations/school"))
        .await;
    assert_eq!(removed.status, ReservationStatus::Active);
    let listed: Vec<ReservationView> = m
        .bob
        .ok(StatusCode::OK, m.bob.get("/v1/reservations"))
        .await;
    assert!(listed.is_empty());
    m.stop().await;
}

#[tokio::test]
async fn others_sessions_on_a_reserved_gpu_are_warned_then_held_when_the_window_opens() {
    let site = Site::new();
    let clock = Arc::new(ManualClock::new(Utc::now()));
    let m = site
        .start_with(two_groups(&site), Some(clock.clone()))
        .await;
    m.node1.register("node1", vec![a100(1)]).await;

    // Alice's (atlas) session runs on the only GPU, kept alive for three hours.
    let body = CreateSession {
        name: Some(SessionName::parse("train1").unwrap()),
        gpus: one_gpu(),
        image: None,
        idle_timeout_secs: None,
        max_duration_secs: None,
        reservation: None,
    };
    let created: SessionView = m
        .alice
        .ok(StatusCode::CREATED, m.alice.post("/v1/sessions", &body))
        .await;
    let running = container(&created, ContainerState::Running, None);
    m.node1
        .sync("node1", vec![a100(1)], vec![running.clone()])
        .await;
    m.alice.wait_for("train1", SessionState::Waiting).await;
    let keep = ongrid_core::holds::KeepRequest {
        duration_secs: 3 * 3600,
    };
    let _: SessionView = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice.post("/v1/sessions/train1/keep", &keep),
        )
        .await;

    // The GPU is reserved for cms from 30 minutes on: Alice's session shows the hold planned at
    // the window's start (the gateway warns her terminals ahead of it).
    let from = clock.now() + TimeDelta::minutes(30);
    let _: ReservationView = m
        .admin
        .ok(
            StatusCode::CREATED,
            m.admin.post(
                "/v1/reservations",
                &reservation("school", from, from + TimeDelta::hours(2)),
            ),
        )
        .await;
    let view: SessionView = m
        .alice
        .ok(StatusCode::OK, m.alice.get("/v1/sessions/train1"))
        .await;
    let next = view
        .lifecycle
        .unwrap()
        .deadlines
        .next_hold
        .expect("a planned hold");
    assert_eq!(
        (next.at, next.reason),
        (from, ongrid_core::holds::HoldReason::Admin)
    );

    // A minute before the window it still runs; when the window opens it is HELD, naming the
    // reservation and its start, and its container is stopped.
    clock.advance(TimeDelta::minutes(29));
    m.node1
        .sync("node1", vec![a100(1)], vec![running.clone()])
        .await;
    let view: SessionView = m
        .alice
        .ok(StatusCode::OK, m.alice.get("/v1/sessions/train1"))
        .await;
    assert_eq!(view.state, SessionState::Waiting);
    clock.advance(TimeDelta::minutes(1));
    m.node1
        .sync("node1", vec![a100(1)], vec![running.clone()])
        .await;
    let held = m.alice.wait_for("train1", SessionState::Held).await;
    assert_eq!(
        held.reason,
        format!(
            "admin: reservation school of group cms started at {} on its GPUs, which are that \
             group's until {}: `devctl session release train1` then, or start a new session \
             elsewhere",
            from.format("%Y-%m-%d %H:%M:%S UTC"),
            (from + TimeDelta::hours(2)).format("%Y-%m-%d %H:%M:%S UTC")
        )
    );
    let desired = m
        .node1
        .sync("node1", vec![a100(1)], vec![running.clone()])
        .await;
    assert_eq!(desired.sessions[0].run, RunState::Stopped);

    // Bob's session in the reservation takes the GPU.
    let school = CreateSession {
        name: Some(SessionName::parse("school").unwrap()),
        reservation: Some("school".to_owned()),
        max_duration_secs: Some(3600),
        ..body
    };
    let session: SessionView = m
        .bob
        .ok(StatusCode::CREATED, m.bob.post("/v1/sessions", &school))
        .await;
    assert_eq!(session.state, SessionState::Starting, "{}", session.reason);
    m.stop().await;
}
