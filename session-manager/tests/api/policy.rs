//! Site policy over the API: a site whose `[policy]` admits only some people refuses everyone
//! else with a 403 that names what is needed and whom to ask, makes no user record for them,
//! and tells the admitted their accounting group.

use ongrid_core::api::UserView;

use super::*;

/// The test site with `[policy]` admitting Alice by DN (group `staff`) and members of VO atlas.
fn restricted(site: &Site) -> Config {
    let text = format!(
        "{}\n[policy]\ncontact = \"gpu-support@example.org\"\nadmit = [\n\
         {{ dn = \"{ALICE}\", group = \"staff\" }},\n{{ vo = \"atlas\" }},\n]\n",
        std::fs::read_to_string(&site.config.path).unwrap()
    );
    Config::from_toml(&text, &site.config.path, |_| None).unwrap()
}

#[tokio::test]
async fn a_certificate_the_policy_does_not_admit_gets_403_with_the_fix_and_leaves_no_user() {
    let site = Site::new();
    let m = site.start_with(restricted(&site), None).await;

    let refused = m
        .bob
        .fails(StatusCode::FORBIDDEN, m.bob.get("/v1/whoami"))
        .await;
    assert_eq!(refused.error.code, "forbidden");
    assert_eq!(
        refused.error.message,
        format!(
            "this site does not admit {BOB} (your credential shows no VOMS attributes): it needs \
             membership of VO atlas; if you are a member, make a proxy with voms-proxy-init \
             --voms atlas; to be admitted, ask gpu-support@example.org"
        )
    );
    let body = CreateSession {
        name: None,
        gpus: one_gpu(),
        image: None,
        idle_timeout_secs: None,
        max_duration_secs: None,
        reservation: None,
    };
    let refused = m
        .bob
        .fails(StatusCode::FORBIDDEN, m.bob.post("/v1/sessions", &body))
        .await;
    assert!(
        refused.error.message.contains("does not admit"),
        "{refused:?}"
    );

    let alice: WhoAmI = m.alice.ok(StatusCode::OK, m.alice.get("/v1/whoami")).await;
    assert_eq!(alice.group.as_deref(), Some("staff"));
    assert_eq!(alice.admitted_by, Some(format!("DN {ALICE}")));
    // The admin matches no rule but is always admitted, in group `admins`.
    let admin: WhoAmI = m.admin.ok(StatusCode::OK, m.admin.get("/v1/whoami")).await;
    assert_eq!(admin.group.as_deref(), Some("admins"));

    // Bob was refused before any record was made for him.
    let users: Vec<UserView> = m.admin.ok(StatusCode::OK, m.admin.get("/v1/users")).await;
    let dns: Vec<&str> = users.iter().map(|u| u.dn.as_str()).collect();
    assert!(dns.contains(&ALICE), "{dns:?}");
    assert!(!dns.contains(&BOB), "{dns:?}");
    m.stop().await;
}

#[tokio::test]
async fn without_a_policy_every_user_of_the_cas_is_admitted_in_group_default() {
    let site = Site::new();
    let m = site.start().await;
    let bob: WhoAmI = m.bob.ok(StatusCode::OK, m.bob.get("/v1/whoami")).await;
    assert_eq!(bob.group.as_deref(), Some("default"));
    assert_eq!(
        bob.admitted_by.as_deref(),
        Some("any user the site authenticates")
    );
    m.stop().await;
}

#[tokio::test]
async fn with_fair_share_the_user_who_used_less_goes_first_and_share_shows_usage() {
    use ongrid_core::api::FairShareView;
    let site = Site::new();
    let text = format!(
        "{}\n[fairshare]\nhalf_life = \"1 day\"\ncost = {{ A100 = 2.0 }}\n",
        std::fs::read_to_string(&site.config.path).unwrap()
    );
    let config = Config::from_toml(&text, &site.config.path, |_| None).unwrap();
    let clock = Arc::new(ManualClock::new(Utc::now()));
    let m = site.start_with(config, Some(clock.clone())).await;
    m.node1.register("node1", vec![a100(1)]).await;

    // Alice holds the only GPU (an A100, weight 2) for an hour.
    m.alice.create(Some("first"), one_gpu()).await;
    m.alice.wait_for("first", SessionState::Starting).await;
    clock.advance(TimeDelta::hours(1));
    // Then Alice queues a second session before Bob queues his: first come, first served would
    // give the GPU to Alice again.
    let again = m.alice.create(Some("again"), one_gpu()).await;
    assert_eq!(again.state, SessionState::Pending);
    let bobs = m.bob.create(Some("bobs"), one_gpu()).await;
    assert_eq!(bobs.state, SessionState::Pending);
    let _: SessionView = m
        .alice
        .ok(StatusCode::OK, m.alice.delete("/v1/sessions/first"))
        .await;
    m.bob.wait_for("bobs", SessionState::Starting).await;
    assert_eq!(m.alice.show("again").await.state, SessionState::Pending);

    // `devctl share`: group default holds Alice's 2 cost-weighted GPU-hours, barely decayed.
    let share: FairShareView = m.alice.ok(StatusCode::OK, m.alice.get("/v1/share")).await;
    assert!(share.enabled);
    assert_eq!(share.half_life_secs, 86_400);
    let default = share
        .groups
        .iter()
        .find(|g| g.group == "default")
        .expect("group default");
    assert!((default.usage - 2.0).abs() < 0.1, "{share:?}");
    assert!((default.usage_fraction - 1.0).abs() < 1e-9, "{share:?}");
    // Alice sees her own line only.
    assert_eq!(default.users.len(), 1, "{share:?}");
    assert_eq!(default.users[0].dn.as_str(), ALICE);
    // An admin sees everyone's.
    let all: FairShareView = m.admin.ok(StatusCode::OK, m.admin.get("/v1/share")).await;
    let default = all.groups.iter().find(|g| g.group == "default").unwrap();
    assert!(
        default.users.iter().any(|u| u.dn.as_str() == BOB),
        "{all:?}"
    );
    m.stop().await;
}

#[tokio::test]
async fn without_fair_share_the_share_route_says_so() {
    use ongrid_core::api::FairShareView;
    let site = Site::new();
    let m = site.start().await;
    let share: FairShareView = m.alice.ok(StatusCode::OK, m.alice.get("/v1/share")).await;
    assert!(!share.enabled);
    assert!(share.groups.is_empty());
    m.stop().await;
}

#[tokio::test]
async fn a_user_at_their_gpu_cap_waits_with_the_limit_named_and_a_request_beyond_it_is_refused() {
    let site = Site::new();
    let text = format!(
        "{}\n[limits]\nuser = {{ max_session_gpus = 1 }}\n",
        std::fs::read_to_string(&site.config.path).unwrap()
    );
    let config = Config::from_toml(&text, &site.config.path, |_| None).unwrap();
    let m = site.start_with(config, None).await;
    m.node1.register("node1", vec![a100(1), a100(2)]).await;

    m.alice.create(Some("first"), one_gpu()).await;
    m.alice.wait_for("first", SessionState::Starting).await;
    // A GPU is free, but Alice holds her one: her second session waits, saying why.
    m.alice.create(Some("second"), one_gpu()).await;
    let second = m.alice.show("second").await;
    assert_eq!(second.state, SessionState::Pending);
    assert_eq!(
        second.reason,
        "waits for a limit: you hold 1 of at most 1 GPUs in sessions (limits.user \
         max_session_gpus)"
    );
    // Bob is not held by Alice's limit.
    m.bob.create(Some("bobs"), one_gpu()).await;
    m.bob.wait_for("bobs", SessionState::Starting).await;
    // A request no limit lets run is refused, naming it.
    let mut two = one_gpu();
    two.count = 2;
    let body = CreateSession {
        name: None,
        gpus: two,
        image: None,
        idle_timeout_secs: None,
        max_duration_secs: None,
        reservation: None,
    };
    let refused = m
        .alice
        .fails(StatusCode::FORBIDDEN, m.alice.post("/v1/sessions", &body))
        .await;
    assert_eq!(
        refused.error.message,
        "a session of 2 GPUs can never run here: limits.user max_session_gpus = 1; ask for at \
         most 1"
    );
    // When the first ends, the second starts.
    let _: SessionView = m
        .alice
        .ok(StatusCode::OK, m.alice.delete("/v1/sessions/first"))
        .await;
    m.alice.wait_for("second", SessionState::Starting).await;
    m.stop().await;
}

/// A job of `max_duration` on one GPU of Alice's image `mymodel:v1`.
fn job_of(max_duration: &str, gpus: u32) -> ongrid_core::job::SubmitJob {
    let mut spec = ongrid_core::job::JobSpecFile {
        image: Some("mymodel:v1".to_owned()),
        command: vec!["python".into(), "train.py".into()],
        max_duration: Some(max_duration.to_owned()),
        ..Default::default()
    };
    spec.gpus = Some(gpus);
    ongrid_core::job::SubmitJob {
        spec: spec.validate(Utc::now()).unwrap(),
        reservation: None,
    }
}

impl Api {
    /// Submits a job; its id.
    async fn submit_job(&self, body: &ongrid_core::job::SubmitJob) -> String {
        let job: ongrid_core::job::JobView = self
            .ok(StatusCode::CREATED, self.post("/v1/jobs", body))
            .await;
        job.id.to_string()
    }

    /// Waits until a QUEUED job's `waiting` (what `devctl job show` prints) is `expected`.
    async fn wait_for_waiting(&self, id: &str, expected: &str) -> ongrid_core::job::JobView {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        loop {
            let view = self.job(id).await;
            if view.waiting.as_deref() == Some(expected) {
                return view;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "job {id} is {} waiting {:?}, not {expected:?}",
                view.state,
                view.waiting
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[tokio::test]
async fn long_work_waits_at_its_length_class_cap_and_work_no_class_takes_is_refused() {
    use ongrid_core::job::JobState;

    let site = Site::new();
    let text = format!(
        "{}\n[limits.length_classes]\nlong_max_gpus = 1\n",
        std::fs::read_to_string(&site.config.path).unwrap()
    );
    let config = Config::from_toml(&text, &site.config.path, |_| None).unwrap();
    let m = site.start_with(config, None).await;
    let gpus = vec![a100(1), a100(2), a100(3)];
    m.node1.register("node1", gpus.clone()).await;
    super::jobs::frozen_image(&m, &gpus).await;

    // A 3-day job is long work: it takes Alice's one long GPU.
    let first = m.alice.submit_job(&job_of("72h", 1)).await;
    m.alice.wait_for_job(&first, JobState::Running).await;
    // A second waits QUEUED with the cap named, though GPUs are free.
    let second = m.alice.submit_job(&job_of("48h", 1)).await;
    let waiting = m
        .alice
        .wait_for_waiting(
            &second,
            "waits for a limit: you hold 1 of at most 1 GPUs in work longer than 1 day \
             (limits.length_classes long_max_gpus)",
        )
        .await;
    assert_eq!(waiting.state, JobState::Queued);
    // A session lives up to the site's maximum lifetime (7 days): long work too.
    m.alice.create(Some("lab"), one_gpu()).await;
    let lab = m.alice.show("lab").await;
    assert_eq!(lab.state, SessionState::Pending);
    assert_eq!(
        lab.reason,
        "waits for a limit: you hold 1 of at most 1 GPUs in work longer than 1 day \
         (limits.length_classes long_max_gpus)"
    );
    // Short work uses the open capacity.
    let short = m.alice.submit_job(&job_of("2h", 1)).await;
    m.alice.wait_for_job(&short, JobState::Running).await;

    // What could never fit is refused, naming the limit.
    let refused = m
        .alice
        .fails(
            StatusCode::FORBIDDEN,
            m.alice.post("/v1/jobs", &job_of("72h", 2)),
        )
        .await;
    assert_eq!(
        refused.error.message,
        "a job of 2 GPUs can never run here: limits.length_classes long_max_gpus: at most 1 \
         GPUs per user in work longer than 1 day; ask for at most 1"
    );
    let refused = m
        .alice
        .fails(
            StatusCode::FORBIDDEN,
            m.alice.post("/v1/jobs", &job_of("8 days", 1)),
        )
        .await;
    assert_eq!(
        refused.error.message,
        "a job of up to 1 week 1 day can never run here: the longest work the site takes is 1 \
         week (limits.length_classes long); ask for a max duration of at most that"
    );

    // When the first long job ends, the waiting session (served before jobs) takes the long
    // GPU and the second job still waits; when the session ends too, the job runs.
    let _: ongrid_core::job::JobView = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice.post(&format!("/v1/jobs/{first}/cancel"), &()),
        )
        .await;
    m.alice.wait_for("lab", SessionState::Starting).await;
    let still = m.alice.job(&second).await;
    assert_eq!(still.state, JobState::Queued);
    assert_eq!(
        still.waiting.as_deref(),
        Some(
            "waits for a limit: you hold 1 of at most 1 GPUs in work longer than 1 day \
             (limits.length_classes long_max_gpus)"
        )
    );
    let _: SessionView = m
        .alice
        .ok(StatusCode::OK, m.alice.delete("/v1/sessions/lab"))
        .await;
    m.alice.wait_for_job(&second, JobState::Running).await;
    m.stop().await;
}

#[tokio::test]
async fn the_gateway_refuses_the_key_of_a_user_the_policy_no_longer_admits() {
    let site = Site::new();
    // The site admits every user of its CAs: Alice and Bob register keys and may log in.
    let m = site.start().await;
    for (user, key) in [(&m.alice, KEY_A), (&m.bob, KEY_C)] {
        let _: KeyView = user
            .ok(StatusCode::CREATED, user.post("/v1/keys", &add_key(key)))
            .await;
    }
    let (status, body) = m.gateway.authorize(KEY_C).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    m.stop().await;

    // Restarted with a [policy] that admits Alice by DN and VO atlas only: Bob's key, registered
    // with a certificate showing no VOMS attributes, no longer opens an SSH session.
    let m = site.start_with(restricted(&site), None).await;
    let (status, body) = m.gateway.authorize(KEY_C).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    assert_eq!(
        message(&body),
        format!(
            "SSH key {KEY_C_FP} cannot log in: this site does not admit {BOB} (your credential \
             shows no VOMS attributes): it needs membership of VO atlas; if you are a member, \
             make a proxy with voms-proxy-init --voms atlas; to be admitted, ask \
             gpu-support@example.org (judged on the credential the key was registered with)"
        )
    );
    let (status, body) = m.gateway.authorize(KEY_A).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    m.stop().await;
}
