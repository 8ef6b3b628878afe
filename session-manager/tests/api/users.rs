//! Removing a user (`DELETE /v1/users/{dn}`) and restoring them: admins only; refused while a
//! session has not ended unless forced; a removal leaves no key, no live session, no queued job,
//! no image (nor its SIF file, and its Docker image is named for the agents to untag) behind;
//! the removed user is refused with how to come back, and the history keeps who they were.

use ongrid_core::api::{
    HeldKey, HeldKeys, Revocation, RevokedKeys, UserAction, UserRemoved, UserView,
};
use ongrid_core::image::{CreateImage, FreezeProgress, ImageReference, ImageView};
use ongrid_core::job::{JobSpecFile, JobState, JobView, SubmitJob};

use super::*;

fn user_path(dn: &str) -> String {
    format!("/v1/users/{}", urlencode(dn))
}

async fn sync_freezes(
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

async fn alices_keys(m: &Running) -> Vec<KeyView> {
    let keys: Vec<KeyView> = m
        .admin
        .ok(StatusCode::OK, m.admin.get("/v1/keys?all=true"))
        .await;
    keys.into_iter()
        .filter(|k| k.owner.as_str() == ALICE)
        .collect()
}

#[tokio::test]
async fn a_removed_user_leaves_no_key_session_job_or_image_and_may_be_restored() {
    let site = Site::new();
    let store = site.dir.path().join("images");
    std::fs::create_dir_all(store.join("sha256")).unwrap();
    let mut config = site.config.clone();
    config.image_store = Some(store.clone());
    let m = site.start_with(config, None).await;
    let gpus = vec![a100(1)];
    m.node1.register("node1", gpus.clone()).await;

    // Alice: a key, a running session, a READY image (with its SIF file) and a queued job
    // (the only GPU is her session's).
    let _: KeyView = m
        .alice
        .ok(
            StatusCode::CREATED,
            m.alice.post("/v1/keys", &add_key(KEY_A)),
        )
        .await;
    let session = m.alice.create(Some("train1"), one_gpu()).await;
    m.alice.wait_for("train1", SessionState::Starting).await;
    let running = vec![container(&session, ContainerState::Running, None)];
    sync_freezes(&m, &gpus, running.clone(), vec![]).await;
    m.alice.wait_for("train1", SessionState::Waiting).await;
    let freeze = CreateImage {
        session: SessionName::parse("train1").unwrap(),
        reference: ImageReference::parse("mymodel:v1").unwrap(),
        force: false,
        compression: Default::default(),
    };
    let image: ImageView = m
        .alice
        .ok(StatusCode::CREATED, m.alice.post("/v1/images", &freeze))
        .await;
    let hex = "cd".repeat(32);
    let sif = store.join("sha256").join(format!("{hex}.sif"));
    std::fs::write(&sif, b"sif").unwrap();
    let done = FreezeProgress::Done {
        image_id: image.id,
        digest: format!("sha256:{hex}"),
        size: 3,
        sif_path: sif.display().to_string(),
        docker_image: "ongrid/alice-smith/mymodel:v1".to_owned(),
    };
    sync_freezes(&m, &gpus, running.clone(), vec![done]).await;
    let spec = JobSpecFile {
        image: Some("mymodel:v1".to_owned()),
        command: vec!["python".into(), "train.py".into()],
        ..JobSpecFile::default()
    }
    .validate(Utc::now())
    .unwrap();
    let job: JobView = m
        .alice
        .ok(
            StatusCode::CREATED,
            m.alice.post(
                "/v1/jobs",
                &SubmitJob {
                    spec,
                    reservation: None,
                },
            ),
        )
        .await;
    assert_eq!(job.state, JobState::Queued);

    // Only admins remove users; nothing changed for a refused caller.
    let alice = user_path(ALICE);
    let refused = m
        .bob
        .fails(StatusCode::FORBIDDEN, m.bob.delete(&alice))
        .await;
    assert!(
        refused.error.message.contains("only admins remove users"),
        "{refused:?}"
    );
    m.alice
        .fails(
            StatusCode::FORBIDDEN,
            m.alice.delete(&format!("{alice}?force=true")),
        )
        .await;
    let listed = m
        .bob
        .fails(StatusCode::FORBIDDEN, m.bob.get("/v1/users"))
        .await;
    assert!(listed.error.message.contains("only admins"), "{listed:?}");
    assert_eq!(alices_keys(&m).await.len(), 1);

    // Strict: unknown query fields, DNs that are none, users never seen.
    m.admin
        .fails(
            StatusCode::BAD_REQUEST,
            m.admin.delete(&format!("{alice}?force=true&evil=1")),
        )
        .await;
    let bad = m
        .admin
        .fails(StatusCode::BAD_REQUEST, m.admin.delete("/v1/users/alice"))
        .await;
    assert!(
        bad.error.message.contains("devctl admin user ls"),
        "{bad:?}"
    );
    m.admin
        .fails(
            StatusCode::NOT_FOUND,
            m.admin.delete(&user_path("/DC=org/CN=Nobody")),
        )
        .await;
    let own = m
        .admin
        .fails(StatusCode::CONFLICT, m.admin.delete(&user_path(ADMIN)))
        .await;
    assert!(
        own.error.message.contains("cannot remove yourself"),
        "{own:?}"
    );

    // A live session refuses the removal unless forced; nothing is removed by the refusal.
    let live = m
        .admin
        .fails(StatusCode::CONFLICT, m.admin.delete(&alice))
        .await;
    assert!(
        live.error.message.contains("session train1 (WAITING)"),
        "{live:?}"
    );
    assert!(live.error.message.contains("--force"), "{live:?}");
    assert_eq!(alices_keys(&m).await.len(), 1);
    assert_eq!(m.alice.show("train1").await.state, SessionState::Waiting);

    let removed: UserRemoved = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin.delete(&format!("{alice}?force=true")),
        )
        .await;
    assert_eq!(removed.keys, vec![KEY_A_FP.to_owned()]);
    assert_eq!(
        removed.sessions,
        vec![SessionName::parse("train1").unwrap()]
    );
    assert_eq!(removed.jobs.len(), 1);
    assert_eq!(removed.jobs[0], job.id);
    assert_eq!(removed.images, vec!["mymodel:v1".to_owned()]);
    assert_eq!(
        removed.user.removed_by.as_ref().map(Dn::as_str),
        Some(ADMIN)
    );
    assert!(removed.user.removed_at.is_some());

    // Nothing is left: no key (the gateway's check closes her connections), the session ENDED
    // and out of the node's desired state, the job CANCELLED, the image gone with its SIF file
    // and its Docker image named for the agent to untag.
    assert!(alices_keys(&m).await.is_empty());
    let check = HeldKeys {
        keys: vec![HeldKey {
            fingerprint: KEY_A_FP.to_owned(),
            owner: Dn::parse(ALICE).unwrap(),
        }],
    };
    let revoked: RevokedKeys = m
        .gateway
        .ok(
            StatusCode::OK,
            m.gateway.post("/v1/gateway/keys/check", &check),
        )
        .await;
    assert_eq!(revoked.revoked.len(), 1);
    assert_eq!(revoked.revoked[0].why, Revocation::Removed);
    // Her connections are told why, and what would help: not `devctl key add`, which the
    // removal refuses, but the admins' restore.
    let told = &revoked.revoked[0].message;
    assert!(
        told.contains(&format!("an admin ({ADMIN}) removed your account {ALICE}")),
        "{told}"
    );
    assert!(told.contains("devctl admin user restore"), "{told}");
    assert!(!told.contains("devctl key add"), "{told}");
    let owner = format!("?owner={}", urlencode(ALICE));
    let ended: SessionView = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin.get(&format!("/v1/sessions/train1{owner}")),
        )
        .await;
    assert_eq!(ended.state, SessionState::Ended);
    assert_eq!(ended.reason, "removed by site-admin");
    assert!(m.admin.list("?all=true").await.is_empty());
    let cancelled: JobView = m
        .admin
        .ok(StatusCode::OK, m.admin.get(&format!("/v1/jobs/{}", job.id)))
        .await;
    assert_eq!(cancelled.state, JobState::Cancelled);
    let images: Vec<ImageView> = m
        .admin
        .ok(StatusCode::OK, m.admin.get("/v1/images?all=true"))
        .await;
    assert!(images.is_empty(), "{images:?}");
    assert!(!sif.exists(), "the SIF file of a removed image is deleted");
    let desired = sync_freezes(&m, &gpus, running.clone(), vec![]).await;
    assert!(
        desired.sessions.iter().all(|s| s.session_id != session.id),
        "{desired:?}"
    );
    assert!(desired.jobs.is_empty(), "{desired:?}");
    assert_eq!(
        desired.removed_images,
        vec!["ongrid/alice-smith/mymodel:v1".to_owned()]
    );

    // Alice is refused, saying how to come back; nothing new is stored for her.
    let who = m
        .alice
        .fails(StatusCode::FORBIDDEN, m.alice.get("/v1/whoami"))
        .await;
    assert!(
        who.error
            .message
            .contains("an admin (/DC=org/O=Example/CN=Site Admin) removed your account"),
        "{who:?}"
    );
    assert!(
        who.error
            .message
            .contains(&format!("devctl admin user restore '{ALICE}'")),
        "{who:?}"
    );
    m.alice
        .fails(
            StatusCode::FORBIDDEN,
            m.alice.post("/v1/keys", &add_key(KEY_A)),
        )
        .await;
    assert!(alices_keys(&m).await.is_empty());
    let again = m
        .admin
        .fails(StatusCode::CONFLICT, m.admin.delete(&alice))
        .await;
    assert!(again.error.message.contains("removed already"), "{again:?}");

    // The list keeps her, marked removed, with the admin's action.
    let users: Vec<UserView> = m.admin.ok(StatusCode::OK, m.admin.get("/v1/users")).await;
    let listed = users.iter().find(|u| u.dn.as_str() == ALICE).unwrap();
    assert_eq!(listed.user_name.as_str(), "alice-smith");
    assert_eq!(listed.removed_by.as_ref().map(Dn::as_str), Some(ADMIN));
    assert_eq!(listed.events.len(), 1);
    assert_eq!(listed.events[0].action, UserAction::Removed);
    assert_eq!(
        listed.events[0].details,
        "1 key(s) deleted, 1 session(s) ended, 1 job(s) cancelled, 1 image(s) removed"
    );

    // Restored: admins only; she is back with her login and UID, what went stays gone.
    m.bob
        .fails(
            StatusCode::FORBIDDEN,
            m.bob.post(&format!("{alice}/restore"), &()),
        )
        .await;
    let restored: UserView = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin.post(&format!("{alice}/restore"), &()),
        )
        .await;
    assert_eq!(restored.removed_at, None);
    assert_eq!(restored.events.len(), 2);
    assert_eq!(restored.events[1].action, UserAction::Restored);
    let who: WhoAmI = m.alice.ok(StatusCode::OK, m.alice.get("/v1/whoami")).await;
    assert_eq!(who.user_name.as_str(), "alice-smith");
    assert_eq!(who.uid, restored.uid);
    assert!(m.alice.list("").await.is_empty());
    m.admin
        .fails(
            StatusCode::CONFLICT,
            m.admin.post(&format!("{alice}/restore"), &()),
        )
        .await;
    m.stop().await;
}

#[tokio::test]
async fn a_user_whose_sessions_all_ended_is_removed_without_force() {
    let site = Site::new();
    let m = site.start().await;
    m.node1.register("node1", vec![a100(1)]).await;
    let _: KeyView = m
        .bob
        .ok(StatusCode::CREATED, m.bob.post("/v1/keys", &add_key(KEY_B)))
        .await;
    m.bob.create(Some("done"), one_gpu()).await;
    let _: SessionView = m
        .bob
        .ok(StatusCode::OK, m.bob.delete("/v1/sessions/done"))
        .await;
    let removed: UserRemoved = m
        .admin
        .ok(StatusCode::OK, m.admin.delete(&user_path(BOB)))
        .await;
    assert_eq!(removed.keys, vec![KEY_B_FP.to_owned()]);
    assert!(removed.sessions.is_empty());
    // Alice is untouched.
    let who: WhoAmI = m.alice.ok(StatusCode::OK, m.alice.get("/v1/whoami")).await;
    assert_eq!(who.dn.as_str(), ALICE);
    m.bob
        .fails(StatusCode::FORBIDDEN, m.bob.get("/v1/sessions"))
        .await;
    m.stop().await;
}
