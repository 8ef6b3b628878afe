//! The web dashboard over real TLS, as a browser without a client certificate uses it: a login
//! link from `POST /v1/dashboard/links` (what `devctl dashboard` prints), spent once for a
//! cookie; pages that show only the viewer's own sessions; forms refused without the login's
//! CSRF token or from another origin; admin pages refused to users; live updates pushed when a
//! session changes.

use ongrid_core::api::{ContainerState, DashboardLink, Institute};
use reqwest::header::{COOKIE, LOCATION, ORIGIN, SET_COOKIE};

use super::*;

/// A browser: no client certificate, no redirects followed, its cookie kept by hand.
struct Browser {
    client: reqwest::Client,
    base: String,
    cookie: Option<String>,
}

impl Browser {
    fn new(site: &Site, addr: SocketAddr) -> Self {
        Self::with_identity(site, addr, None)
    }

    /// A browser that presents the client certificate (and key) `pem`, when given.
    fn with_identity(site: &Site, addr: SocketAddr, pem: Option<&[u8]>) -> Self {
        let mut builder = reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .add_root_certificate(reqwest::Certificate::from_pem(site.ca_pem.as_bytes()).unwrap())
            .redirect(reqwest::redirect::Policy::none())
            .timeout(Duration::from_secs(20));
        if let Some(pem) = pem {
            builder = builder.identity(reqwest::Identity::from_pem(pem).unwrap());
        }
        let client = builder.build().unwrap();
        Self {
            client,
            base: format!("https://{addr}"),
            cookie: None,
        }
    }

    fn with_cookie(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.cookie {
            Some(cookie) => request.header(COOKIE, cookie),
            None => request,
        }
    }

    async fn get(&self, path: &str) -> (StatusCode, String) {
        let response = self
            .with_cookie(self.client.get(format!("{}{path}", self.base)))
            .send()
            .await
            .unwrap();
        (response.status(), response.text().await.unwrap())
    }

    /// A form POST from the dashboard's own origin; the answer and its `Location`.
    async fn post(
        &self,
        path: &str,
        form: &[(&str, &str)],
    ) -> (StatusCode, Option<String>, String) {
        self.post_from(path, form, &self.base.clone()).await
    }

    async fn post_from(
        &self,
        path: &str,
        form: &[(&str, &str)],
        origin: &str,
    ) -> (StatusCode, Option<String>, String) {
        let response = self
            .with_cookie(self.client.post(format!("{}{path}", self.base)))
            .header(ORIGIN, origin)
            .form(form)
            .send()
            .await
            .unwrap();
        let location = response
            .headers()
            .get(LOCATION)
            .map(|v| v.to_str().unwrap().to_owned());
        (response.status(), location, response.text().await.unwrap())
    }

    /// Logs in with a link made by `api`'s caller; returns the `Set-Cookie` line.
    async fn log_in(&mut self, api: &Api) -> String {
        let link: DashboardLink = api
            .ok(
                StatusCode::CREATED,
                api.request(reqwest::Method::POST, "/v1/dashboard/links"),
            )
            .await;
        let token = link
            .path
            .strip_prefix("/dashboard/login?token=")
            .unwrap_or_else(|| panic!("a login path: {}", link.path))
            .to_owned();
        let (status, page) = self.get(&link.path).await;
        assert_eq!(status, StatusCode::OK, "{page}");
        assert!(page.contains("action=\"/dashboard/login\""), "{page}");
        let response = self
            .client
            .post(format!("{}/dashboard/login", self.base))
            .header(ORIGIN, &self.base)
            .form(&[("token", token.as_str())])
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::SEE_OTHER);
        assert_eq!(response.headers()[LOCATION], "/dashboard/");
        let set_cookie = response.headers()[SET_COOKIE].to_str().unwrap().to_owned();
        let pair = set_cookie.split(';').next().unwrap().to_owned();
        self.cookie = Some(pair);

        // The token was spent: a second use is refused.
        let (status, _, page) = self
            .post("/dashboard/login", &[("token", token.as_str())])
            .await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert!(page.contains("devctl dashboard"), "{page}");
        set_cookie
    }
}

/// The CSRF token of a dashboard page's forms.
fn csrf(page: &str) -> String {
    let marker = "name=\"csrf\" value=\"";
    let start = page
        .find(marker)
        .unwrap_or_else(|| panic!("no CSRF field: {page}"))
        + marker.len();
    page[start..start + page[start..].find('"').unwrap()].to_owned()
}

#[tokio::test]
async fn a_login_link_logs_a_browser_in_once_and_it_sees_and_changes_only_its_own() {
    let site = Site::new();
    let m = site.start().await;
    m.node1.register("node1", vec![a100(1), a100(2)]).await;
    let train = m.alice.create(Some("train1"), one_gpu()).await;
    let bobs = m.bob.create(Some("bobs-secret"), one_gpu()).await;
    m.node1
        .sync(
            "node1",
            vec![a100(1), a100(2)],
            vec![
                container(&train, ContainerState::Running, None),
                container(&bobs, ContainerState::Running, None),
            ],
        )
        .await;
    m.alice.wait_for("train1", SessionState::Waiting).await;

    // Without a login: a page that says how to get one.
    let mut alice = Browser::new(&site, m.addr);
    let (status, page) = alice.get("/dashboard/").await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(page.contains("devctl dashboard"), "{page}");
    let (status, _) = alice.get("/dashboard/login?token=0123").await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "an unknown token logs nobody in"
    );

    let set_cookie = alice.log_in(&m.alice).await;
    for part in [
        "HttpOnly",
        "Secure",
        "SameSite=Strict",
        "Path=/dashboard",
        "Max-Age=",
    ] {
        assert!(set_cookie.contains(part), "{part} missing: {set_cookie}");
    }
    let (status, page) = alice.get("/dashboard/").await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert!(
        page.contains("train1") && page.contains("WAITING"),
        "{page}"
    );
    assert!(page.contains("node1"), "{page}");
    assert!(
        !page.contains("bobs-secret") && !page.contains("Bob Jones"),
        "Alice sees nothing of Bob's: {page}"
    );
    let token = csrf(&page);

    // Forms without the login's CSRF token, or from another origin, change nothing.
    let (status, _, page) = alice
        .post("/dashboard/sessions/train1/hold", &[("csrf", "forged")])
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{page}");
    assert!(page.contains("CSRF"), "{page}");
    let (status, _, _) = alice
        .post_from(
            "/dashboard/sessions/train1/hold",
            &[("csrf", token.as_str())],
            "https://evil.test.invalid",
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_eq!(m.alice.show("train1").await.state, SessionState::Waiting);

    // Bob's session cannot be reached, even naming him as its owner: the same 404 as nothing.
    let (status, _, _) = alice
        .post(
            "/dashboard/sessions/bobs-secret/hold",
            &[
                ("csrf", token.as_str()),
                ("owner", BOB),
                ("reason", "mine now"),
            ],
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(m.bob.show("bobs-secret").await.state, SessionState::Waiting);

    // The page's own form holds it, as devctl session hold would, and says so once.
    let (status, location, _) = alice
        .post(
            "/dashboard/sessions/train1/hold",
            &[("csrf", token.as_str())],
        )
        .await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert_eq!(location.as_deref(), Some("/dashboard/"));
    let held = m.alice.show("train1").await;
    assert_eq!(held.state, SessionState::Held);
    assert_eq!(held.reason, "owner: held by alice-smith");

    // Admin pages and their live view are refused to users.
    let (status, page) = alice.get("/dashboard/admin").await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{page}");
    let (status, _) = alice.get("/dashboard/events?view=admin").await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, _, _) = alice
        .post(
            "/dashboard/admin/institutes",
            &[
                ("csrf", token.as_str()),
                ("name", "sneaky"),
                ("networks", "0.0.0.0/0"),
            ],
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);

    // An admin sees every session and the nodes, and adds an institute.
    let mut admin = Browser::new(&site, m.addr);
    admin.log_in(&m.admin).await;
    let (status, page) = admin.get("/dashboard/admin").await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert!(
        page.contains("train1") && page.contains("bobs-secret"),
        "{page}"
    );
    assert!(
        page.contains("node1") && page.contains("GPU-11111111"),
        "{page}"
    );
    let admin_token = csrf(&page);
    assert_ne!(admin_token, token, "each login has its own CSRF token");
    let (status, location, page) = admin
        .post(
            "/dashboard/admin/institutes",
            &[
                ("csrf", admin_token.as_str()),
                ("name", "physics"),
                ("networks", "192.0.2.0/24, 2001:db8::/32"),
            ],
        )
        .await;
    assert_eq!(status, StatusCode::SEE_OTHER, "{page}");
    assert_eq!(location.as_deref(), Some("/dashboard/admin"));
    let institutes: Vec<Institute> = m
        .admin
        .ok(StatusCode::OK, m.admin.get("/v1/institutes"))
        .await;
    assert_eq!(institutes.len(), 1);
    assert_eq!(institutes[0].name.to_string(), "physics");
    assert_eq!(institutes[0].cidrs.len(), 2);

    // Logging out ends the cookie's login.
    let (status, _, _) = alice
        .post("/dashboard/logout", &[("csrf", token.as_str())])
        .await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    let (status, _) = alice.get("/dashboard/").await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    m.stop().await;
}

#[tokio::test]
async fn the_live_view_is_pushed_when_a_session_changes() {
    let site = Site::new();
    let m = site.start().await;
    m.node1.register("node1", vec![a100(1)]).await;
    let train = m.alice.create(Some("train1"), one_gpu()).await;
    m.node1
        .sync(
            "node1",
            vec![a100(1)],
            vec![container(&train, ContainerState::Running, None)],
        )
        .await;
    m.alice.wait_for("train1", SessionState::Waiting).await;
    let mut alice = Browser::new(&site, m.addr);
    alice.log_in(&m.alice).await;
    let response = alice
        .with_cookie(
            alice
                .client
                .get(format!("{}/dashboard/events?view=user", alice.base)),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let mut response = response;

    // A hold through the API (devctl) reaches the open page at once, not at its next refresh.
    let started = tokio::time::Instant::now();
    let _: SessionView = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice
                .post("/v1/sessions/train1/hold", &serde_json::json!({})),
        )
        .await;
    let mut seen = String::new();
    while !seen.contains("event: update") || !seen.contains(">HELD<") {
        let chunk = tokio::time::timeout(Duration::from_secs(10), response.chunk())
            .await
            .expect("an update within 10 s")
            .unwrap()
            .expect("the stream stays open");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(
        started.elapsed() < ongrid_manager::dashboard::LIVE_REFRESH,
        "pushed by the change, not by the periodic refresh"
    );
    assert!(!seen.contains("bobs"), "{seen}");
    drop(response);
    m.stop().await;
}

#[tokio::test]
async fn a_browser_with_a_grid_certificate_needs_no_link_but_its_forms_need_the_token() {
    let site = Site::new();
    let m = site.start().await;
    m.node1.register("node1", vec![a100(1)]).await;
    m.alice.create(Some("train1"), one_gpu()).await;

    // The certificate presented in the TLS handshake logs the browser in, as it does devctl.
    let (status, page) = m.alice.send(m.alice.get("/dashboard/")).await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert!(page.contains("train1"), "{page}");
    assert!(!page.contains("Log out"), "nothing to log out of: {page}");
    let token = csrf(&page);
    let (status, page) = m.bob.send(m.bob.get("/dashboard/")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        !page.contains("train1"),
        "Bob sees nothing of Alice's: {page}"
    );
    assert_ne!(csrf(&page), token, "each user has their own token");

    // A cross-site form would carry the certificate too: without the token it changes nothing.
    let hold = |csrf: &str| {
        m.alice
            .request(reqwest::Method::POST, "/dashboard/sessions/train1/hold")
            .header(ORIGIN, &m.alice.base)
            .form(&[("csrf", csrf.to_owned())])
    };
    let (status, page) = m.alice.send(hold("")).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{page}");
    let (status, page) = m
        .bob
        .send(
            m.bob
                .request(reqwest::Method::POST, "/dashboard/sessions/train1/hold")
                .header(ORIGIN, &m.bob.base)
                .form(&[("csrf", token.as_str())]),
        )
        .await;
    assert_eq!(
        status,
        StatusCode::FORBIDDEN,
        "Alice's token is not Bob's: {page}"
    );
    assert_eq!(m.alice.show("train1").await.state, SessionState::Starting);
    // With it, the hold is done and the page (after the redirect) says so.
    let (status, page) = m.alice.send(hold(&token)).await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert!(page.contains(">HELD<"), "{page}");
    assert_eq!(m.alice.show("train1").await.state, SessionState::Held);
    m.stop().await;
}

/// Every dashboard form, with the fields the page sends and one it never does, is refused with
/// a 422 naming that field, and does nothing.
#[tokio::test]
async fn every_dashboard_form_refuses_an_unknown_field() {
    let site = Site::new();
    let m = site.start().await;
    m.node1.register("node1", vec![a100(1)]).await;
    let mut admin = Browser::new(&site, m.addr);
    admin.log_in(&m.admin).await;
    let (status, page) = admin.get("/dashboard/admin").await;
    assert_eq!(status, StatusCode::OK, "{page}");
    let token = csrf(&page);
    let token = token.as_str();
    let gpu = a100(1).uuid.to_string();
    let job = uuid::Uuid::new_v4().to_string();
    let extra = ("privileged", "true");
    let forms: Vec<(String, Vec<(&str, &str)>)> = vec![
        ("/dashboard/logout".into(), vec![("csrf", token)]),
        (
            "/dashboard/sessions".into(),
            vec![("csrf", token), ("gpus", "1")],
        ),
        (
            "/dashboard/sessions/dev/hold".into(),
            vec![("csrf", token), ("back", "user")],
        ),
        (
            "/dashboard/freeze".into(),
            vec![("csrf", token), ("session", "dev"), ("tag", "m:v1")],
        ),
        (
            format!("/dashboard/jobs/{job}/cancel"),
            vec![("csrf", token)],
        ),
        (
            format!("/dashboard/jobs/{job}/remove"),
            vec![("csrf", token)],
        ),
        (
            "/dashboard/admin/institutes".into(),
            vec![
                ("csrf", token),
                ("name", "lab"),
                ("networks", "192.0.2.0/24"),
            ],
        ),
        (
            "/dashboard/admin/institutes/lab/remove".into(),
            vec![("csrf", token)],
        ),
        (
            "/dashboard/admin/nodes/node1/drain".into(),
            vec![("csrf", token), ("reason", "disk")],
        ),
        (
            format!("/dashboard/admin/gpus/{gpu}/drain"),
            vec![("csrf", token), ("reason", "fan")],
        ),
    ];
    for (path, mut form) in forms {
        form.push(extra);
        let (status, _, text) = admin.post(&path, &form).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{path}: {text}");
        assert!(
            text.contains("unknown field `privileged`"),
            "{path}: {text}"
        );
    }
    // The login form, before any cookie.
    let browser = Browser::new(&site, m.addr);
    let (status, _, text) = browser
        .post("/dashboard/login", &[("token", "0123"), extra])
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{text}");
    assert!(text.contains("unknown field `privileged`"), "{text}");

    // Nothing was done: still logged in, no session, no institute, nothing drained.
    let (status, page) = admin.get("/dashboard/admin").await;
    assert_eq!(
        status,
        StatusCode::OK,
        "the logout form was refused: {page}"
    );
    assert!(m.admin.list("?all=true").await.is_empty());
    let institutes: Vec<Institute> = m
        .admin
        .ok(StatusCode::OK, m.admin.get("/v1/institutes"))
        .await;
    assert!(institutes.is_empty(), "{institutes:?}");
    let node: NodeView = m
        .admin
        .ok(StatusCode::OK, m.admin.get("/v1/nodes/node1"))
        .await;
    assert!(
        node.drain.is_none() && node.gpus[0].drain.is_none(),
        "{node:?}"
    );
    m.stop().await;
}

/// The admin forms refuse a user before reading the form: a malformed one (no CSRF token, a
/// field no form has) gets the 403 that says only admins may, not a 422 about the form.
#[tokio::test]
async fn admin_forms_refuse_users_before_reading_them() {
    let site = Site::new();
    let m = site.start().await;
    m.node1.register("node1", vec![a100(1)]).await;
    let mut alice = Browser::new(&site, m.addr);
    alice.log_in(&m.alice).await;
    let gpu = a100(1).uuid.to_string();
    for path in [
        "/dashboard/admin/institutes".to_owned(),
        "/dashboard/admin/institutes/lab/remove".to_owned(),
        "/dashboard/admin/nodes/node1/drain".to_owned(),
        format!("/dashboard/admin/gpus/{gpu}/drain"),
    ] {
        let (status, _, page) = alice.post(&path, &[("evil", "1")]).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{path}: {page}");
        assert!(page.contains("only admins"), "{path}: {page}");
    }
    m.stop().await;
}

/// A login link is bound to the DN it was made for, and a login cookie to its user: Bob's link
/// opened by a browser presenting Alice's certificate is refused without being spent, and a
/// request carrying Alice's certificate with Bob's cookie is refused instead of served as Bob.
#[tokio::test]
async fn a_login_never_acts_under_another_persons_certificate() {
    let site = Site::new();
    let m = site.start().await;
    let link: DashboardLink = m
        .bob
        .ok(
            StatusCode::CREATED,
            m.bob.request(reqwest::Method::POST, "/v1/dashboard/links"),
        )
        .await;
    let token = link.path.strip_prefix("/dashboard/login?token=").unwrap();
    let alices = Browser::with_identity(&site, m.addr, Some(site.alice_pem.as_slice()));
    let (status, _, page) = alices.post("/dashboard/login", &[("token", token)]).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{page}");
    assert!(page.contains("presents the certificate of"), "{page}");

    // Not spent: Bob's own browser logs in with it.
    let mut bobs = Browser::new(&site, m.addr);
    let response = bobs
        .client
        .post(format!("{}/dashboard/login", bobs.base))
        .header(ORIGIN, &bobs.base)
        .form(&[("token", token)])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    let set_cookie = response.headers()[SET_COOKIE].to_str().unwrap().to_owned();
    bobs.cookie = Some(set_cookie.split(';').next().unwrap().to_owned());
    let (status, page) = bobs.get("/dashboard/").await;
    assert_eq!(status, StatusCode::OK, "{page}");

    // Bob's cookie in a browser that presents Alice's certificate.
    let mut mixed = Browser::with_identity(&site, m.addr, Some(site.alice_pem.as_slice()));
    mixed.cookie = bobs.cookie.clone();
    let (status, page) = mixed.get("/dashboard/").await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{page}");
    assert!(page.contains("presents the certificate of"), "{page}");
    // Alice's certificate alone still works.
    let (status, page) = alices.get("/dashboard/").await;
    assert_eq!(status, StatusCode::OK, "{page}");
    m.stop().await;
}

/// A login link may lead to a page of the dashboard (`devctl session web`): the login page's
/// form carries it and the login redirects there. A next path off the dashboard is refused
/// when the link is asked for (400, saying what one must be), and in the link's query or the
/// form, before the token is spent. No body, an empty one and `{}` still get a plain link.
#[tokio::test]
async fn a_login_link_with_a_next_page_lands_there_and_only_under_the_dashboard() {
    let site = Site::new();
    let m = site.start().await;
    let next = "/dashboard/sessions/train1/apps/jupyter/lab?file=a%20b.ipynb";
    let link: DashboardLink = m
        .alice
        .ok(
            StatusCode::CREATED,
            m.alice
                .post("/v1/dashboard/links", &serde_json::json!({ "next": next })),
        )
        .await;
    let (token, query_next) = link
        .path
        .strip_prefix("/dashboard/login?token=")
        .and_then(|rest| rest.split_once("&next="))
        .unwrap_or_else(|| panic!("a login path with a next page: {}", link.path));
    assert_eq!(
        query_next,
        "/dashboard/sessions/train1/apps/jupyter/lab%3Ffile%3Da%2520b.ipynb"
    );

    let browser = Browser::new(&site, m.addr);
    let (status, page) = browser.get(&link.path).await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert!(
        page.contains(&format!("name=\"next\" value=\"{next}\"")),
        "{page}"
    );

    // A next page changed to leave the dashboard, in the link or in the form: refused, and the
    // token is not spent.
    let (status, page) = browser
        .get(&format!(
            "/dashboard/login?token={token}&next=https%3A%2F%2Fevil.test.invalid%2F"
        ))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{page}");
    assert!(page.contains("a next path must be"), "{page}");
    for bad in [
        "//evil.test.invalid",
        "/dashboard/../v1/whoami",
        "/\\evil.test.invalid",
    ] {
        let (status, _, page) = browser
            .post("/dashboard/login", &[("token", token), ("next", bad)])
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {page}");
        assert!(page.contains("a next path must be"), "{bad}: {page}");
    }

    // The form as the page made it: logged in, and on to the next page.
    let response = browser
        .client
        .post(format!("{}/dashboard/login", browser.base))
        .header(ORIGIN, &browser.base)
        .form(&[("token", token), ("next", next)])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    assert_eq!(response.headers()[LOCATION], next);
    let set_cookie = response.headers()[SET_COOKIE].to_str().unwrap();
    assert!(set_cookie.starts_with("ongrid_dashboard="), "{set_cookie}");

    // Links asked for with a next page off the dashboard.
    for bad in [
        "//evil.test.invalid",
        "/dashboard/../v1",
        "/dashboard/%2e%2e/v1",
        "https://x",
        "/\\evil",
        "/dashboard/\r\nSet-Cookie: a=b",
    ] {
        let error = m
            .alice
            .fails(
                StatusCode::BAD_REQUEST,
                m.alice
                    .post("/v1/dashboard/links", &serde_json::json!({ "next": bad })),
            )
            .await;
        assert!(
            error
                .error
                .message
                .contains("a next path must be a path under /dashboard/"),
            "{bad:?}: {error:?}"
        );
    }
    let error = m
        .alice
        .fails(
            StatusCode::BAD_REQUEST,
            m.alice
                .post("/v1/dashboard/links", &serde_json::json!({ "nxt": next })),
        )
        .await;
    assert!(
        error.error.message.contains("unknown field `nxt`"),
        "{error:?}"
    );

    // No body, an empty one, `{}`: a link to the front page, as before.
    for request in [
        m.alice
            .request(reqwest::Method::POST, "/v1/dashboard/links"),
        m.alice
            .request(reqwest::Method::POST, "/v1/dashboard/links")
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(""),
        m.alice.post("/v1/dashboard/links", &serde_json::json!({})),
    ] {
        let link: DashboardLink = m.alice.ok(StatusCode::CREATED, request).await;
        assert!(
            link.path.starts_with("/dashboard/login?token=") && !link.path.contains("next"),
            "{}",
            link.path
        );
    }
    m.stop().await;
}

/// The API and the dashboard call the same use cases, and neither wakes anyone itself: the same
/// change through either wakes the same waiters. Here the node's long-poll, for a freeze asked
/// and a session removed, each once through each. The sync interval is an hour, so only the
/// use case's wake-up can answer the long-poll within the seconds it is given.
#[tokio::test]
async fn the_same_change_through_the_api_and_the_dashboard_wakes_the_same_waiters() {
    use super::watch::{long_poll, register_versioned};
    use ongrid_core::SessionId;

    let site = Site::new();
    let store = site.dir.path().join("images");
    std::fs::create_dir_all(store.join("sha256")).unwrap();
    let mut config = site.config.clone();
    config.image_store = Some(store);
    config.sync_interval = Duration::from_secs(3600);
    let m = site.start_with(config, None).await;
    let gpus = vec![a100(1), a100(2)];
    register_versioned(&m.node1, "node1", gpus.clone()).await;
    let by_api = m.alice.create(Some("by-api"), one_gpu()).await;
    let by_page = m.alice.create(Some("by-page"), one_gpu()).await;
    m.node1
        .sync(
            "node1",
            gpus,
            vec![
                container(&by_api, ContainerState::Running, None),
                container(&by_page, ContainerState::Running, None),
            ],
        )
        .await;
    m.alice.wait_for("by-api", SessionState::Waiting).await;
    m.alice.wait_for("by-page", SessionState::Waiting).await;
    let mut browser = Browser::new(&site, m.addr);
    browser.log_in(&m.alice).await;
    let (_, page) = browser.get("/dashboard/").await;
    let token = csrf(&page);
    // A version the agent does not have is answered at once, with the current one.
    let (_, mut version, _) = long_poll(&m.node1, "0123456789abcdef", 120).await.unwrap();

    // Waits for the node's long-poll to answer `change` with a desired state that `shows`.
    async fn answered(
        node: &Api,
        version: &mut String,
        what: &str,
        change: impl std::future::Future<Output = ()>,
        shows: impl Fn(&DesiredState) -> bool,
    ) {
        let poll = long_poll(node, version, 120);
        change.await;
        let (status, new, desired) = tokio::time::timeout(Duration::from_secs(10), poll)
            .await
            .unwrap_or_else(|_| panic!("{what}: the node's long-poll was not woken"))
            .unwrap();
        assert_eq!(status, StatusCode::OK, "{what}");
        let desired = desired.unwrap();
        assert!(shows(&desired), "{what}: {desired:?}");
        *version = new;
    }
    let freezing =
        |id: SessionId| move |d: &DesiredState| d.freezes.iter().any(|f| f.session_id == id);
    let gone = |id: SessionId| {
        move |d: &DesiredState| {
            d.sessions
                .iter()
                .all(|s| s.session_id != id || s.run != RunState::Running)
        }
    };

    answered(
        &m.node1,
        &mut version,
        "a freeze through the API",
        async {
            let request = m.alice.post(
                "/v1/images",
                &super::images::freeze("by-api", "api:v1", false),
            );
            let response = request.send().await.unwrap();
            assert_eq!(response.status(), StatusCode::CREATED);
        },
        freezing(by_api.id),
    )
    .await;
    answered(
        &m.node1,
        &mut version,
        "a freeze on the dashboard",
        async {
            let (status, _, page) = browser
                .post(
                    "/dashboard/freeze",
                    &[("csrf", &token), ("session", "by-page"), ("tag", "page:v1")],
                )
                .await;
            assert_eq!(status, StatusCode::SEE_OTHER, "{page}");
        },
        freezing(by_page.id),
    )
    .await;
    answered(
        &m.node1,
        &mut version,
        "a removal through the API",
        async {
            let response = m.alice.delete("/v1/sessions/by-api").send().await.unwrap();
            assert_eq!(response.status(), StatusCode::OK);
        },
        gone(by_api.id),
    )
    .await;
    answered(
        &m.node1,
        &mut version,
        "a removal on the dashboard",
        async {
            let (status, _, page) = browser
                .post("/dashboard/sessions/by-page/remove", &[("csrf", &token)])
                .await;
            assert_eq!(status, StatusCode::SEE_OTHER, "{page}");
        },
        gone(by_page.id),
    )
    .await;
    m.stop().await;
}
