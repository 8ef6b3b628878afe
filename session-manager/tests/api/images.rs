//! Frozen images through the API: freeze requests and what is refused, the freeze orders in
//! the node's desired state, the agent's progress, done and failed reports, tags moved with
//! `force` (the old image reachable by digest), privacy, and removal with the SIF file.

use ongrid_core::image::{CreateImage, FreezeProgress, ImageReference, ImageState, ImageView};

use super::*;

pub(super) fn freeze(session: &str, reference: &str, force: bool) -> CreateImage {
    CreateImage {
        session: SessionName::parse(session).unwrap(),
        reference: ImageReference::parse(reference).unwrap(),
        force,
        compression: Default::default(),
    }
}

async fn report(
    m: &Running,
    gpus: &[GpuInfo],
    containers: Vec<ObservedContainer>,
    freezes: Vec<FreezeProgress>,
) -> DesiredState {
    let body = NodeReport {
        node: NodeName::parse("node1").unwrap(),
        gpus: gpus.to_vec(),
        containers,
        activity: Vec::new(),
        freezes,
        jobs: Vec::new(),
    };
    m.node1
        .ok(StatusCode::OK, m.node1.post("/v1/agent/sync", &body))
        .await
}

#[tokio::test]
async fn freezes_are_ordered_reported_and_removed() {
    let site = Site::new();
    let store = site.dir.path().join("images");
    std::fs::create_dir_all(store.join("sha256")).unwrap();
    let mut config = site.config.clone();
    config.image_store = Some(store.clone());
    let m = site.start_with(config, None).await;
    let gpus = vec![a100(1)];
    m.node1.register("node1", gpus.clone()).await;

    let session = m.alice.create(Some("train1"), one_gpu()).await;
    m.alice.wait_for("train1", SessionState::Starting).await;
    // Not running yet: nothing to commit.
    let refused = m
        .alice
        .fails(
            StatusCode::CONFLICT,
            m.alice
                .post("/v1/images", &freeze("train1", "mymodel:v1", false)),
        )
        .await;
    assert!(refused.error.message.contains("STARTING"), "{refused:?}");
    let running = vec![container(&session, ContainerState::Running, None)];
    report(&m, &gpus, running.clone(), vec![]).await;
    m.alice.wait_for("train1", SessionState::Waiting).await;

    // Bad input and other people's sessions.
    let (status, body) = m
        .alice
        .send(m.alice.post(
            "/v1/images",
            &serde_json::json!({"session": "train1", "reference": "MyModel"}),
        ))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.contains("NAME:VERSION"), "{body}");
    let missing = m
        .bob
        .fails(
            StatusCode::NOT_FOUND,
            m.bob
                .post("/v1/images", &freeze("train1", "mymodel:v1", false)),
        )
        .await;
    assert!(missing.error.message.contains("devctl session ls"));
    // Bob's session is queued behind Alice's on the only GPU: never started.
    m.bob.create(Some("queued"), one_gpu()).await;
    let pending = m
        .bob
        .fails(
            StatusCode::CONFLICT,
            m.bob.post("/v1/images", &freeze("queued", "x:1", false)),
        )
        .await;
    assert!(pending.error.message.contains("PENDING"), "{pending:?}");

    // The freeze: BUILDING, and an order for node1.
    let image: ImageView = m
        .alice
        .ok(
            StatusCode::CREATED,
            m.alice
                .post("/v1/images", &freeze("train1", "mymodel:v1", false)),
        )
        .await;
    assert_eq!(image.state, ImageState::Building);
    assert_eq!(image.reference, "mymodel:v1");
    assert_eq!(image.node.as_str(), "node1");
    assert_eq!(image.session.as_str(), "train1");
    assert_eq!(image.owner.as_str(), ALICE);
    let again = m
        .alice
        .fails(
            StatusCode::CONFLICT,
            m.alice
                .post("/v1/images", &freeze("train1", "other:v1", false)),
        )
        .await;
    assert!(again.error.message.contains("being frozen"), "{again:?}");
    let desired = report(&m, &gpus, running.clone(), vec![]).await;
    assert_eq!(desired.freezes.len(), 1);
    let order = &desired.freezes[0];
    assert_eq!(order.image_id, image.id);
    assert_eq!(order.session_id, session.id);
    assert_eq!(order.reference, "mymodel:v1");
    assert_eq!(order.base_image, session.image);

    // Progress, then done.
    report(
        &m,
        &gpus,
        running.clone(),
        vec![FreezeProgress::Running {
            image_id: image.id,
            bytes_done: 40,
            bytes_total: 100,
        }],
    )
    .await;
    let shown: ImageView = m
        .alice
        .ok(StatusCode::OK, m.alice.get("/v1/images/mymodel:v1"))
        .await;
    let progress = shown.progress.unwrap();
    assert_eq!((progress.bytes_done, progress.bytes_total), (40, 100));
    let hex = "ab".repeat(32);
    let digest = format!("sha256:{hex}");
    let sif = store.join("sha256").join(format!("{hex}.sif"));
    std::fs::write(&sif, "SIF").unwrap();
    let desired = report(
        &m,
        &gpus,
        running.clone(),
        vec![FreezeProgress::Done {
            image_id: image.id,
            digest: digest.clone(),
            size: 3,
            sif_path: sif.display().to_string(),
            docker_image: "ongrid/alice-smith/mymodel:v1".to_owned(),
        }],
    )
    .await;
    assert!(desired.freezes.is_empty(), "{:?}", desired.freezes);
    let ready: ImageView = m
        .alice
        .ok(StatusCode::OK, m.alice.get("/v1/images/mymodel:v1"))
        .await;
    assert_eq!(ready.state, ImageState::Ready);
    assert_eq!(ready.digest.as_deref(), Some(digest.as_str()));
    assert_eq!(ready.size, Some(3));
    assert_eq!(
        ready.docker_image.as_deref(),
        Some("ongrid/alice-smith/mymodel:v1")
    );
    assert_eq!(ready.progress, None);
    // A late report changes nothing.
    report(
        &m,
        &gpus,
        running.clone(),
        vec![FreezeProgress::Failed {
            image_id: image.id,
            reason: "late".to_owned(),
        }],
    )
    .await;
    let still: ImageView = m
        .alice
        .ok(StatusCode::OK, m.alice.get("/v1/images/mymodel:v1"))
        .await;
    assert_eq!(still.state, ImageState::Ready);

    // The tag is taken unless forced; forced, the old image stays reachable by digest.
    let taken = m
        .alice
        .fails(
            StatusCode::CONFLICT,
            m.alice
                .post("/v1/images", &freeze("train1", "mymodel:v1", false)),
        )
        .await;
    assert!(taken.error.message.contains("--force"), "{taken:?}");
    let second: ImageView = m
        .alice
        .ok(
            StatusCode::CREATED,
            m.alice
                .post("/v1/images", &freeze("train1", "mymodel:v1", true)),
        )
        .await;
    assert_ne!(second.id, image.id);
    let by_digest: ImageView = m
        .alice
        .ok(StatusCode::OK, m.alice.get(&format!("/v1/images/{digest}")))
        .await;
    assert_eq!(by_digest.id, image.id);
    assert!(by_digest.superseded_at.is_some());
    report(
        &m,
        &gpus,
        running.clone(),
        vec![FreezeProgress::Failed {
            image_id: second.id,
            reason: "image store /x is full: free space or ask the admin".to_owned(),
        }],
    )
    .await;
    let failed: ImageView = m
        .alice
        .ok(StatusCode::OK, m.alice.get("/v1/images/mymodel:v1"))
        .await;
    assert_eq!(failed.id, second.id);
    assert_eq!(failed.state, ImageState::Failed);
    assert!(failed.reason.contains("is full"));

    // Privacy: users see their own, admins all.
    let mine: Vec<ImageView> = m.alice.ok(StatusCode::OK, m.alice.get("/v1/images")).await;
    assert_eq!(mine.len(), 2);
    let bobs: Vec<ImageView> = m.bob.ok(StatusCode::OK, m.bob.get("/v1/images")).await;
    assert!(bobs.is_empty());
    m.bob
        .fails(StatusCode::NOT_FOUND, m.bob.get("/v1/images/mymodel:v1"))
        .await;
    m.bob
        .fails(
            StatusCode::NOT_FOUND,
            m.bob.get(&format!("/v1/images/{digest}")),
        )
        .await;
    m.bob
        .fails(
            StatusCode::NOT_FOUND,
            m.bob
                .get(&format!("/v1/images/mymodel:v1?owner={}", urlencode(ALICE))),
        )
        .await;
    m.bob
        .fails(StatusCode::FORBIDDEN, m.bob.get("/v1/images?all=true"))
        .await;
    let all: Vec<ImageView> = m
        .admin
        .ok(StatusCode::OK, m.admin.get("/v1/images?all=true"))
        .await;
    assert_eq!(all.len(), 2);
    let admin_view: ImageView = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin
                .get(&format!("/v1/images/mymodel:v1?owner={}", urlencode(ALICE))),
        )
        .await;
    assert_eq!(admin_view.id, second.id);
    m.bob
        .fails(
            StatusCode::NOT_FOUND,
            m.bob.delete(&format!("/v1/images/{digest}")),
        )
        .await;
    m.alice
        .fails(
            StatusCode::BAD_REQUEST,
            m.alice.get("/v1/images/sha256:abc"),
        )
        .await;

    // Removal: the failed current tag, then the old image by digest with its SIF file.
    let removed: ImageView = m
        .alice
        .ok(StatusCode::OK, m.alice.delete("/v1/images/mymodel:v1"))
        .await;
    assert_eq!(removed.state, ImageState::Deleted);
    m.alice
        .fails(StatusCode::NOT_FOUND, m.alice.get("/v1/images/mymodel:v1"))
        .await;
    assert!(sif.exists(), "the READY image still uses it");
    let removed: ImageView = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice.delete(&format!("/v1/images/{digest}")),
        )
        .await;
    assert_eq!((removed.id, removed.state), (image.id, ImageState::Deleted));
    assert!(!sif.exists(), "no image references the digest any more");
    let mine: Vec<ImageView> = m.alice.ok(StatusCode::OK, m.alice.get("/v1/images")).await;
    assert!(mine.is_empty());
    // The tag is free again.
    m.alice
        .ok::<ImageView>(
            StatusCode::CREATED,
            m.alice
                .post("/v1/images", &freeze("train1", "mymodel:v1", false)),
        )
        .await;
    m.stop().await;
}

#[tokio::test]
async fn removing_a_building_image_withdraws_its_order() {
    let site = Site::new();
    let m = site.start().await;
    let gpus = vec![a100(1)];
    m.node1.register("node1", gpus.clone()).await;
    let session = m.alice.create(Some("train1"), one_gpu()).await;
    m.alice.wait_for("train1", SessionState::Starting).await;
    report(
        &m,
        &gpus,
        vec![container(&session, ContainerState::Running, None)],
        vec![],
    )
    .await;
    m.alice.wait_for("train1", SessionState::Waiting).await;

    let image: ImageView = m
        .alice
        .ok(
            StatusCode::CREATED,
            m.alice.post("/v1/images", &freeze("train1", "m:1", false)),
        )
        .await;
    let desired = report(&m, &gpus, vec![], vec![]).await;
    assert_eq!(desired.freezes.len(), 1);
    // Removing a BUILDING image withdraws the order (the agent cancels it).
    m.alice
        .ok::<ImageView>(StatusCode::OK, m.alice.delete("/v1/images/m:1"))
        .await;
    let desired = report(&m, &gpus, vec![], vec![]).await;
    assert!(desired.freezes.is_empty());
    // A report on it is ignored.
    report(
        &m,
        &gpus,
        vec![],
        vec![FreezeProgress::Failed {
            image_id: image.id,
            reason: "cancelled".to_owned(),
        }],
    )
    .await;
    let all: Vec<ImageView> = m
        .admin
        .ok(StatusCode::OK, m.admin.get("/v1/images?all=true"))
        .await;
    assert!(all.is_empty());
    m.stop().await;
}

/// Polls until the image is no longer BUILDING (the freeze watch runs every 2 s of real time).
async fn ended(m: &Running, reference: &str) -> ImageView {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let image: ImageView = m
            .alice
            .ok(
                StatusCode::OK,
                m.alice.get(&format!("/v1/images/{reference}")),
            )
            .await;
        if image.state != ImageState::Building {
            return image;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "image {reference} still BUILDING after 30 s: {image:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_freeze_that_cannot_finish_is_failed_not_left_building() {
    let site = Site::new();
    let clock = Arc::new(ManualClock::new(Utc::now()));
    let mut config = site.config.clone();
    config.freeze_stall_timeout = Duration::from_secs(600);
    let m = site.start_with(config, Some(clock.clone())).await;
    let gpus = vec![a100(1)];
    m.node1.register("node1", gpus.clone()).await;
    let session = m.alice.create(Some("train1"), one_gpu()).await;
    m.alice.wait_for("train1", SessionState::Starting).await;
    let running = vec![container(&session, ContainerState::Running, None)];
    report(&m, &gpus, running.clone(), vec![]).await;
    m.alice.wait_for("train1", SessionState::Waiting).await;

    // Stalled: the node syncs, but the freeze's progress stops moving.
    let stalled: ImageView = m
        .alice
        .ok(
            StatusCode::CREATED,
            m.alice.post("/v1/images", &freeze("train1", "m:1", false)),
        )
        .await;
    let at = |bytes_done| FreezeProgress::Running {
        image_id: stalled.id,
        bytes_done,
        bytes_total: 100,
    };
    report(&m, &gpus, running.clone(), vec![at(10)]).await;
    clock.advance(TimeDelta::minutes(6));
    report(&m, &gpus, running.clone(), vec![at(20)]).await;
    clock.advance(TimeDelta::minutes(6));
    // 12 minutes since the freeze started, 6 since it moved; then 11 without a move.
    report(&m, &gpus, running.clone(), vec![at(20)]).await;
    clock.advance(TimeDelta::minutes(5));
    report(&m, &gpus, running.clone(), vec![at(20)]).await;
    let failed = ended(&m, "m:1").await;
    assert_eq!(failed.state, ImageState::Failed);
    assert!(
        failed
            .reason
            .starts_with("the freeze made no progress on node node1 for 10 minutes"),
        "{}",
        failed.reason
    );
    let desired = report(&m, &gpus, running.clone(), vec![]).await;
    assert!(desired.freezes.is_empty(), "the order is withdrawn");

    // The node stops syncing during a freeze of the HELD session.
    let held: SessionView = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice
                .post("/v1/sessions/train1/hold", &serde_json::json!({})),
        )
        .await;
    assert_eq!(held.state, SessionState::Held);
    let stopped = vec![container(
        &session,
        ContainerState::Exited {
            exit_code: 0,
            oom_killed: false,
            error: None,
        },
        None,
    )];
    report(&m, &gpus, stopped.clone(), vec![]).await;
    m.alice
        .ok::<ImageView>(
            StatusCode::CREATED,
            m.alice.post("/v1/images", &freeze("train1", "m:2", false)),
        )
        .await;
    clock.advance(TimeDelta::minutes(61));
    let failed = ended(&m, "m:2").await;
    assert_eq!(failed.state, ImageState::Failed);
    assert!(
        failed
            .reason
            .starts_with("node node1 stopped responding during the freeze"),
        "{}",
        failed.reason
    );

    // The session is removed while its node says nothing about the freeze.
    report(&m, &gpus, stopped.clone(), vec![]).await;
    m.alice
        .ok::<ImageView>(
            StatusCode::CREATED,
            m.alice.post("/v1/images", &freeze("train1", "m:3", false)),
        )
        .await;
    m.alice
        .ok::<SessionView>(StatusCode::OK, m.alice.delete("/v1/sessions/train1"))
        .await;
    let failed = ended(&m, "m:3").await;
    assert_eq!(failed.state, ImageState::Failed);
    assert_eq!(
        failed.reason,
        "session train1 was removed during the freeze"
    );
    m.stop().await;
}

/// `POST /v1/sessions` with `image`, as devctl sends `--image`.
async fn new_session_with(api: &Api, name: &str, image: &str) -> (StatusCode, String) {
    let body = CreateSession {
        name: Some(SessionName::parse(name).unwrap()),
        gpus: one_gpu(),
        image: Some(image.to_owned()),
        idle_timeout_secs: None,
        max_duration_secs: None,
        reservation: None,
    };
    api.send(api.post("/v1/sessions", &body)).await
}

#[tokio::test]
async fn sessions_run_only_site_images_and_the_callers_own_frozen_images() {
    let site = Site::new();
    let mut config = site.config.clone();
    config.allowed_images = vec!["python:3.12".to_owned()];
    let m = site.start_with(config, None).await;
    let gpus = vec![a100(1)];
    m.node1.register("node1", gpus.clone()).await;
    let session = m.alice.create(Some("train1"), one_gpu()).await;
    m.alice.wait_for("train1", SessionState::Starting).await;
    let running = vec![container(&session, ContainerState::Running, None)];
    report(&m, &gpus, running.clone(), vec![]).await;
    m.alice.wait_for("train1", SessionState::Waiting).await;

    // A tag that looks like a digest is refused at freeze time.
    let (status, body) = m
        .alice
        .send(m.alice.post(
            "/v1/images",
            &serde_json::json!({"session": "train1", "reference": format!("sha256:{}", "ab".repeat(32))}),
        ))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.contains("looks like a content digest"), "{body}");

    let image: ImageView = m
        .alice
        .ok(
            StatusCode::CREATED,
            m.alice
                .post("/v1/images", &freeze("train1", "mymodel:v1", false)),
        )
        .await;
    let digest = format!("sha256:{}", "cd".repeat(32));
    let docker_image = "ongrid/alice-smith/mymodel:v1";
    let done = FreezeProgress::Done {
        image_id: image.id,
        digest: digest.clone(),
        size: 3,
        sif_path: "/images/sha256/cd.sif".to_owned(),
        docker_image: docker_image.to_owned(),
    };
    let desired = report(&m, &gpus, running.clone(), vec![done]).await;
    assert!(desired.removed_images.is_empty(), "{desired:?}");

    // Bob may use neither Alice's frozen image (by her tag, her digest or its Docker name) nor
    // a Docker image the site does not list; the refusal says what he may use.
    for (name, requested) in [
        ("a", "mymodel:v1"),
        ("b", digest.as_str()),
        ("c", docker_image),
        ("d", "ubuntu:22.04"),
        ("e", "alpine"),
    ] {
        let (status, body) = new_session_with(&m.bob, name, requested).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{requested}: {body}");
        assert!(
            body.contains("ongrid/dev:latest, python:3.12") && body.contains("devctl image ls"),
            "{requested}: {body}"
        );
    }
    assert!(m.bob.list("").await.is_empty(), "nothing was created");
    // The site's images are his to use.
    let (status, body) = new_session_with(&m.bob, "py", "python:3.12").await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(m.bob.show("py").await.image, "python:3.12");

    // Alice uses her own by tag or digest, never by its raw Docker name; the desired state
    // carries the Docker image.
    let (status, body) = new_session_with(&m.alice, "bytag", "mymodel:v1").await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(m.alice.show("bytag").await.image, docker_image);
    let (status, body) = new_session_with(&m.alice, "bydigest", &digest).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(m.alice.show("bydigest").await.image, docker_image);
    let (status, body) = new_session_with(&m.alice, "raw", docker_image).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");

    // Removed, the image starts nothing and every node is told to untag it, until the tag is
    // frozen again.
    m.alice
        .ok::<ImageView>(StatusCode::OK, m.alice.delete("/v1/images/mymodel:v1"))
        .await;
    let (status, body) = new_session_with(&m.alice, "gone", "mymodel:v1").await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    assert!(
        body.contains("there is no frozen image mymodel:v1 that you may run"),
        "{body}"
    );
    let desired = report(&m, &gpus, running.clone(), vec![]).await;
    assert_eq!(desired.removed_images, [docker_image]);
    let other_node = m.node2.register("node2", vec![a100(2)]).await;
    assert_eq!(other_node.removed_images, [docker_image]);
    m.alice
        .ok::<ImageView>(
            StatusCode::CREATED,
            m.alice
                .post("/v1/images", &freeze("train1", "mymodel:v1", false)),
        )
        .await;
    let desired = report(&m, &gpus, running, vec![]).await;
    assert!(desired.removed_images.is_empty(), "{desired:?}");
    m.stop().await;
}

/// Bob may neither start a session nor submit a job with any of `images`; each refusal
/// holds `expected`.
async fn bob_is_refused(bob: &Api, images: &[&str], expected: &str) {
    for requested in images {
        let (status, body) = new_session_with(bob, "s", requested).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{requested}: {body}");
        assert!(body.contains(expected), "{requested}: {body}");
        let (status, body) = submit_job_with(bob, requested).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{requested}: {body}");
        assert!(body.contains(expected), "{requested}: {body}");
    }
}

/// `POST /v1/jobs` of `image`, as `devctl job submit --image` sends it.
async fn submit_job_with(api: &Api, image: &str) -> (StatusCode, String) {
    let spec = ongrid_core::job::JobSpecFile {
        image: Some(image.to_owned()),
        command: vec!["true".into()],
        ..ongrid_core::job::JobSpecFile::default()
    }
    .validate(Utc::now())
    .unwrap();
    api.send(api.post(
        "/v1/jobs",
        &ongrid_core::job::SubmitJob {
            spec,
            reservation: None,
        },
    ))
    .await
}

#[tokio::test]
async fn another_users_image_runs_only_while_its_owner_shares_it() {
    let site = Site::new();
    let m = site.start().await;
    let gpus = vec![a100(1)];
    m.node1.register("node1", gpus.clone()).await;
    let session = m.alice.create(Some("train1"), one_gpu()).await;
    m.alice.wait_for("train1", SessionState::Starting).await;
    let running = vec![container(&session, ContainerState::Running, None)];
    report(&m, &gpus, running.clone(), vec![]).await;
    m.alice.wait_for("train1", SessionState::Waiting).await;
    let image: ImageView = m
        .alice
        .ok(
            StatusCode::CREATED,
            m.alice
                .post("/v1/images", &freeze("train1", "mymodel:v1", false)),
        )
        .await;
    // Sharing waits for READY.
    let early = m
        .alice
        .fails(
            StatusCode::CONFLICT,
            m.alice.post("/v1/images/mymodel:v1/share", &()),
        )
        .await;
    assert!(
        early
            .error
            .message
            .contains("only a READY image can be shared"),
        "{early:?}"
    );
    let digest = format!("sha256:{}", "cd".repeat(32));
    let docker_image = "ongrid/alice-smith/mymodel:v1";
    let done = FreezeProgress::Done {
        image_id: image.id,
        digest: digest.clone(),
        size: 3,
        sif_path: "/images/sha256/cd.sif".to_owned(),
        docker_image: docker_image.to_owned(),
    };
    report(&m, &gpus, running, vec![done]).await;
    let shared_name = "alice-smith/mymodel:v1";
    let shared_path = "/v1/images/alice-smith%2Fmymodel:v1";

    // Private: Bob can neither run it (by login and tag, or by digest), see it, nor share it.
    bob_is_refused(&m.bob, &[shared_name, &digest], "that you may run").await;
    m.bob
        .fails(StatusCode::NOT_FOUND, m.bob.get(shared_path))
        .await;
    for action in ["share", "unshare"] {
        m.bob
            .fails(
                StatusCode::NOT_FOUND,
                m.bob.post(&format!("{shared_path}/{action}"), &()),
            )
            .await;
    }
    let listed: Vec<ImageView> = m
        .bob
        .ok(StatusCode::OK, m.bob.get("/v1/images?shared=true"))
        .await;
    assert!(listed.is_empty(), "{listed:?}");

    // Shared (by its owner's login name too): Bob lists, shows and runs it.
    let shared: ImageView = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice.post(&format!("{shared_path}/share"), &()),
        )
        .await;
    assert!(shared.shared);
    let listed: Vec<ImageView> = m
        .bob
        .ok(StatusCode::OK, m.bob.get("/v1/images?shared=true"))
        .await;
    assert_eq!(
        listed.iter().map(|i| i.id).collect::<Vec<_>>(),
        [image.id],
        "{listed:?}"
    );
    let seen: ImageView = m.bob.ok(StatusCode::OK, m.bob.get(shared_path)).await;
    assert!(seen.shared);
    // Seeing is not owning: Bob still cannot unshare or remove it.
    m.bob
        .fails(
            StatusCode::NOT_FOUND,
            m.bob.post(&format!("{shared_path}/unshare"), &()),
        )
        .await;
    m.bob
        .fails(StatusCode::NOT_FOUND, m.bob.delete(shared_path))
        .await;
    let (status, body) = new_session_with(&m.bob, "shared", shared_name).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(m.bob.show("shared").await.image, docker_image);
    for requested in [shared_name, digest.as_str()] {
        let (status, body) = submit_job_with(&m.bob, requested).await;
        assert_eq!(status, StatusCode::CREATED, "{requested}: {body}");
        let job: ongrid_core::job::JobView = serde_json::from_str(&body).unwrap();
        assert_eq!(job.image_digest.as_deref(), Some(digest.as_str()), "{body}");
    }
    // NAME:VERSION alone is always one's own: Bob has no mymodel:v1.
    let (status, body) = new_session_with(&m.bob, "own", "mymodel:v1").await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    assert!(
        body.contains("there is no frozen image mymodel:v1 that you may run"),
        "{body}"
    );

    // Private again: new sessions and jobs are refused; what started keeps its image.
    let private: ImageView = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice.post("/v1/images/mymodel:v1/unshare", &()),
        )
        .await;
    assert!(!private.shared);
    bob_is_refused(&m.bob, &[shared_name, &digest], "that you may run").await;
    assert_eq!(m.bob.show("shared").await.image, docker_image);
    m.stop().await;
}

/// Far shorter than the image long-poll's timeout (60 s) and any periodic interval here (an
/// hour between syncs; no agent runs): only the manager's push answers within it.
const PUSHED_WITHIN: Duration = Duration::from_secs(5);

/// `GET /v1/images/{reference}?after=DONE/TOTAL&timeout=S`, in its own task.
fn image_wait(api: &Api, reference: &str, after: &str, timeout: u64) -> JoinHandle<ImageView> {
    let request = api
        .get(&format!(
            "/v1/images/{reference}?after={after}&timeout={timeout}"
        ))
        .timeout(Duration::from_secs(timeout + 30));
    tokio::spawn(async move {
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        response.json().await.unwrap()
    })
}

fn progress(image: &ImageView) -> (u64, u64) {
    let p = image.progress.expect("a BUILDING image has progress");
    (p.bytes_done, p.bytes_total)
}

#[tokio::test]
async fn a_freeze_wait_is_answered_by_the_agents_report_and_only_by_a_change() {
    let site = Site::new();
    let mut config = site.config.clone();
    config.sync_interval = Duration::from_secs(3600);
    let m = site.start_with(config, None).await;
    let gpus = vec![a100(1)];
    m.node1.register("node1", gpus.clone()).await;
    let session = m.alice.create(Some("train1"), one_gpu()).await;
    m.alice.wait_for("train1", SessionState::Starting).await;
    let running = vec![container(&session, ContainerState::Running, None)];
    report(&m, &gpus, running.clone(), vec![]).await;
    m.alice.wait_for("train1", SessionState::Waiting).await;
    let image: ImageView = m
        .alice
        .ok(
            StatusCode::CREATED,
            m.alice
                .post("/v1/images", &freeze("train1", "mymodel:v1", false)),
        )
        .await;
    assert_eq!(progress(&image), (0, 0));
    let at = |done: u64, total: u64| FreezeProgress::Running {
        image_id: image.id,
        bytes_done: done,
        bytes_total: total,
    };

    // Nothing changes: the wait takes its whole timeout and answers the image as it is.
    let started = tokio::time::Instant::now();
    let same = image_wait(&m.alice, "mymodel:v1", "0/0", 1).await.unwrap();
    assert!(started.elapsed() >= Duration::from_secs(1), "it waited");
    assert_eq!(
        (same.state, progress(&same)),
        (ImageState::Building, (0, 0))
    );
    // Progress the caller does not have is answered at once.
    let at_once = tokio::time::timeout(
        PUSHED_WITHIN,
        image_wait(&m.alice, "mymodel:v1", "5/10", 60),
    )
    .await
    .expect("a different progress is answered at once")
    .unwrap();
    assert_eq!(progress(&at_once), (0, 0));

    // The agent's report of the estimated total answers the wait.
    let waiting = image_wait(&m.alice, "mymodel:v1", "0/0", 60);
    report(&m, &gpus, running.clone(), vec![at(0, 4096)]).await;
    let view = tokio::time::timeout(PUSHED_WITHIN, waiting)
        .await
        .expect("the agent's progress report answered the wait")
        .unwrap();
    assert_eq!(progress(&view), (0, 4096));

    // A sync that reports the same progress (it notifies) does not answer it: the waiter looks
    // again and keeps waiting until its timeout.
    let started = tokio::time::Instant::now();
    let waiting = image_wait(&m.alice, "mymodel:v1", "0/4096", 2);
    report(&m, &gpus, running.clone(), vec![at(0, 4096)]).await;
    let view = waiting.await.unwrap();
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "answered without a change after {:?}",
        started.elapsed()
    );
    assert_eq!(progress(&view), (0, 4096));

    // Bytes read answer it; so does the end of the freeze.
    let waiting = image_wait(&m.alice, "mymodel:v1", "0/4096", 60);
    report(&m, &gpus, running.clone(), vec![at(1024, 4096)]).await;
    let view = tokio::time::timeout(PUSHED_WITHIN, waiting)
        .await
        .expect("the agent's progress report answered the wait")
        .unwrap();
    assert_eq!(progress(&view), (1024, 4096));
    let waiting = image_wait(&m.alice, "mymodel:v1", "1024/4096", 60);
    let done = FreezeProgress::Done {
        image_id: image.id,
        digest: format!("sha256:{}", "ab".repeat(32)),
        size: 4000,
        sif_path: "/store/sha256/ab.sif".to_owned(),
        docker_image: "ongrid/alice-smith/mymodel:v1".to_owned(),
    };
    report(&m, &gpus, running.clone(), vec![done]).await;
    let view = tokio::time::timeout(PUSHED_WITHIN, waiting)
        .await
        .expect("the agent's report of the finished freeze answered the wait")
        .unwrap();
    assert_eq!(view.state, ImageState::Ready);
    assert_eq!(view.size, Some(4000));
    // A finished image is answered at once, whatever the caller has.
    let ready = tokio::time::timeout(
        PUSHED_WITHIN,
        image_wait(&m.alice, "mymodel:v1", "1024/4096", 60),
    )
    .await
    .expect("a READY image is answered at once")
    .unwrap();
    assert_eq!(ready.state, ImageState::Ready);

    let refused = m
        .alice
        .fails(
            StatusCode::BAD_REQUEST,
            m.alice.get("/v1/images/mymodel:v1?after=half"),
        )
        .await;
    assert!(
        refused.error.message.contains("BYTES_DONE/BYTES_TOTAL"),
        "{}",
        refused.error.message
    );
    // Bob waits on nothing of Alice's.
    m.bob
        .fails(
            StatusCode::NOT_FOUND,
            m.bob.get("/v1/images/mymodel:v1?after=0/0&timeout=60"),
        )
        .await;
    m.stop().await;
}
