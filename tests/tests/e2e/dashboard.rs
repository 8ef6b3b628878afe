//! The web dashboard in a real browser: headless Chromium driven through chromedriver
//! (WebDriver, the fantoccini client) against the real manager, agent and Docker. A user logs
//! in with the link `devctl dashboard` prints, starts a session and sees it running, holds and
//! releases it, freezes it and sees the freeze's progress; a second user sees none of it; an
//! admin adds an institute. Every page change the test waits for arrives by the page's live
//! updates or its own form posts, never by the test reloading.
//!
//! The test starts chromedriver itself (on a port it picks, `--port=0`) in its own process group
//! and kills that group, and any Chromium left with the test's profile directory, when it ends,
//! pass or fail. Screenshots of the user and admin pages go to the test's directory, or to
//! `$ONGRID_DASHBOARD_SCREENSHOTS` when set (README's come from there).

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use ongrid_e2e::{SimGpu, Site, User};
use serde_json::{json, Value};

/// chromedriver and the Chromiums it starts; all killed when dropped.
struct Driver {
    child: Child,
    port: u16,
    /// The profile directories of the browsers, unique to this test.
    profiles: tempfile::TempDir,
}

impl Driver {
    fn start() -> Self {
        let profiles = tempfile::Builder::new()
            .prefix("ongrid-e2e-chromium-")
            .tempdir()
            .expect("profile directory");
        let mut child = Command::new("chromedriver")
            .arg("--port=0")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("chromedriver must be installed (Debian: chromium-driver)");
        let stdout = child.stdout.take().expect("chromedriver's stdout");
        let mut lines = BufReader::new(stdout).lines();
        let port = loop {
            let line = match lines.next() {
                Some(Ok(line)) => line,
                _ => {
                    let _ = child.kill();
                    panic!("chromedriver exited before saying its port");
                }
            };
            if let Some(rest) = line.split("started successfully on port ").nth(1) {
                break rest.trim_end_matches('.').trim().parse().expect("a port");
            }
        };
        // Keep reading, so chromedriver never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Self {
            child,
            port,
            profiles,
        }
    }

    /// A new headless Chromium with its own profile (so its own cookies).
    async fn browser(&self, name: &str) -> Client {
        let profile = self.profiles.path().join(name);
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".to_owned(),
            json!({
                "binary": "/usr/bin/chromium",
                "args": [
                    "--headless=new",
                    "--no-sandbox",
                    "--disable-dev-shm-usage",
                    "--disable-gpu",
                    // The harness's throwaway CA is not in the browser's store.
                    "--ignore-certificate-errors",
                    "--window-size=1440,1000",
                    format!("--user-data-dir={}", profile.display()),
                ],
            }),
        );
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        ClientBuilder::new(connector)
            .capabilities(caps)
            .connect(&format!("http://127.0.0.1:{}", self.port))
            .await
            .expect("a WebDriver session of chromedriver")
    }

    /// Processes whose command line names this test's profiles (Chromium and its helpers).
    fn browsers_left(&self) -> Vec<u32> {
        let marker = self.profiles.path().display().to_string();
        let mut pids = Vec::new();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            if let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) {
                if String::from_utf8_lossy(&cmdline).contains(&marker) {
                    pids.push(pid);
                }
            }
        }
        pids
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let group = format!("-{}", self.child.id());
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.child.kill();
        let _ = self.child.wait();
        for pid in self.browsers_left() {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
    }
}

/// A Docker image the test makes (the frozen image's), removed when dropped, pass or fail.
struct RemoveImage(String);

impl Drop for RemoveImage {
    fn drop(&mut self) {
        let _ = Command::new("docker").args(["rmi", "-f", &self.0]).output();
    }
}

/// The link `devctl dashboard` prints for `user`.
fn dashboard_link(site: &Site, user: &User) -> String {
    let out = site.devctl_ok(user, &["dashboard"]);
    assert!(out.contains("works once"), "{out}");
    eprintln!("$ devctl dashboard\n{out}");
    out.lines()
        .map(str::trim)
        .find(|line| line.starts_with("https://"))
        .unwrap_or_else(|| panic!("no link in: {out}"))
        .to_owned()
}

/// Waits until `css` matches an element (the page's live updates bring it).
async fn wait_for(client: &Client, css: &str, within: Duration) {
    wait_or(client, css, within, String::new).await
}

/// [`wait_for`], with `diagnose` saying what else to show when it does not come.
///
/// Chromium drops what it has in flight when the host's network changes, and Docker changes it
/// whenever a dev container starts (a bridge, a veth): the page is then Chromium's own error
/// page (ERR_NETWORK_CHANGED). The page is opened again then, as a person would reload it.
async fn wait_or(client: &Client, css: &str, within: Duration, diagnose: impl FnOnce() -> String) {
    let deadline = Instant::now() + within;
    loop {
        let found = client.find_all(Locator::Css(css)).await.unwrap_or_default();
        if !found.is_empty() {
            return;
        }
        reload_if_network_changed(client).await;
        if Instant::now() > deadline {
            let page = client.source().await.unwrap_or_default();
            panic!(
                "{css} did not appear within {within:?}; the page:\n{page}\n{}",
                diagnose()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Opens the page again when Chromium shows its own error page instead (see [`wait_or`]).
async fn reload_if_network_changed(client: &Client) {
    // Chromium's error page, or a loaded live page whose script's request was dropped (the
    // script marks the page `data-following` when it runs; deferred scripts run before the
    // document is complete).
    let error_page = client
        .execute(
            "var b = document.body; return !!(b && (b.classList.contains('neterror') || \
             (document.readyState === 'complete' && b.hasAttribute('data-live') && \
             !b.hasAttribute('data-following'))));",
            Vec::new(),
        )
        .await
        .ok()
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    if error_page {
        let url = client.current_url().await.expect("the page's URL");
        let home = if url.path().starts_with("/dashboard/admin") {
            "/dashboard/admin"
        } else {
            "/dashboard/"
        };
        let again = url.join(home).expect("a dashboard URL");
        client
            .goto(again.as_str())
            .await
            .expect("open the page again");
    }
}

async fn log_in(client: &Client, link: &str) {
    client.goto(link).await.expect("open the login link");
    // Other tests start containers meanwhile: on Chromium's network-changed page the link is
    // opened again as it is (opening it does not spend it, the button does; the dashboard's
    // home, where `wait_for` goes, would only say "not logged in").
    let deadline = Instant::now() + Duration::from_secs(30);
    while client
        .find_all(Locator::Css("#log-in"))
        .await
        .unwrap_or_default()
        .is_empty()
    {
        let network_changed = client
            .execute(
                "return !!(document.body && document.body.classList.contains('neterror'));",
                Vec::new(),
            )
            .await
            .ok()
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        if network_changed {
            client.goto(link).await.expect("open the login link again");
        }
        if Instant::now() > deadline {
            let page = client.source().await.unwrap_or_default();
            panic!("#log-in did not appear within 30s; the page:\n{page}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    client
        .find(Locator::Css("#log-in"))
        .await
        .expect("the login button")
        .click()
        .await
        .expect("log in");
    wait_for(client, "#start-session", Duration::from_secs(10)).await;
}

async fn fill(client: &Client, css: &str, text: &str) {
    let input = client.find(Locator::Css(css)).await.expect(css);
    input.clear().await.expect("clear");
    input.send_keys(text).await.expect("type");
}

/// Clicks `css`, looking again if a live update replaced the element meanwhile.
async fn click(client: &Client, css: &str) {
    for _ in 0..5 {
        let element = client
            .find(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("{css}: {e}"));
        match element.click().await {
            Ok(()) => return,
            Err(e) if e.to_string().contains("stale element") => continue,
            Err(e) => panic!("click {css}: {e}"),
        }
    }
    panic!("{css} kept being replaced");
}

/// The text of the element `css` matches, read in one script (a live update may replace it
/// between two WebDriver calls).
async fn text_of(client: &Client, css: &str) -> String {
    let script = format!(
        "const e = document.querySelector({}); return e ? e.innerText : null;",
        json!(css)
    );
    let text = client
        .execute(&script, Vec::new())
        .await
        .expect("read the page");
    text.as_str()
        .unwrap_or_else(|| panic!("no {css}"))
        .to_owned()
}

async fn screenshot(client: &Client, dir: &Path, name: &str) {
    let png = client.screenshot().await.expect("screenshot");
    assert!(png.starts_with(b"\x89PNG"), "a PNG");
    std::fs::create_dir_all(dir).expect("screenshot directory");
    std::fs::write(dir.join(name), png).expect("write screenshot");
}

fn session_state(site: &Site, user: &User, name: &str) -> String {
    let view: Value = site
        .devctl_json(user, &["session", "show", name])
        .expect("session show");
    view["state"].as_str().unwrap_or_default().to_owned()
}

/// When the page does not show what the test waits for: the manager's own view of the user's
/// sessions and the site's logs, to tell a slow start from a missed live update.
fn what_the_site_says(site: &Site, user: &User) -> String {
    let ls = site.devctl(user, &["session", "ls"]);
    format!(
        "--- devctl session ls ---\n{}{}\n{}",
        String::from_utf8_lossy(&ls.stdout),
        String::from_utf8_lossy(&ls.stderr),
        site.logs()
    )
}

#[test]
fn a_user_runs_holds_releases_and_freezes_a_session_from_the_browser() {
    let mut site = Site::start_configured(
        &[SimGpu::a100(1)],
        "[dashboard]\nssh_host = \"gateway.example.org\"\nssh_port = 2222",
        "",
    );
    let alice = site.user("Alice");
    let bob = site.user("Bob");
    let admin = site.admin.clone();
    let shots: PathBuf = std::env::var_os("ONGRID_DASHBOARD_SCREENSHOTS")
        .map_or_else(|| site.dir.path().join("screenshots"), PathBuf::from);
    let _frozen = RemoveImage(format!("ongrid/{}/mymodel:v1", site.login_of("Alice")));
    let driver = Driver::start();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        // Alice logs in with her link; it works once.
        let link = dashboard_link(&site, &alice);
        let base = link[..link.find("/dashboard/").expect("a dashboard path")].to_owned();
        let browser = driver.browser("alice").await;
        log_in(&browser, &link).await;
        browser.goto(&link).await.expect("open the link again");
        let page = browser.source().await.expect("page");
        assert!(page.contains("used already or has expired"), "{page}");
        browser
            .goto(&format!("{base}/dashboard/"))
            .await
            .expect("back to the dashboard");

        // She starts a session and sees it running, with the ssh command.
        fill(&browser, "#new-name", "train1").await;
        click(&browser, "#start-session").await;
        let waiting = r#"tr[data-session="train1"][data-state="WAITING"]"#;
        wait_or(&browser, waiting, Duration::from_secs(120), || {
            what_the_site_says(&site, &alice)
        })
        .await;
        let text = text_of(&browser, waiting).await;
        assert!(text.contains("WAITING"), "the state is written out: {text}");
        assert!(text.contains(&site.node), "{text}");
        assert!(
            text.contains("ssh -p 2222 train1@gateway.example.org"),
            "{text}"
        );
        assert_eq!(session_state(&site, &alice, "train1"), "WAITING");
        screenshot(&browser, &shots, "dashboard-user.png").await;

        // Hold, then release: the page follows both.
        click(
            &browser,
            r#"tr[data-session="train1"] form[action$="/hold"] button"#,
        )
        .await;
        let held = r#"tr[data-session="train1"][data-state="HELD"]"#;
        wait_for(&browser, held, Duration::from_secs(30)).await;
        let text = text_of(&browser, held).await;
        assert!(text.contains("held by"), "the reason is shown: {text}");
        assert_eq!(session_state(&site, &alice, "train1"), "HELD");
        click(
            &browser,
            r#"tr[data-session="train1"] form[action$="/release"] button"#,
        )
        .await;
        wait_or(&browser, waiting, Duration::from_secs(120), || {
            what_the_site_says(&site, &alice)
        })
        .await;
        assert_eq!(session_state(&site, &alice, "train1"), "WAITING");

        // Freeze it: the images table shows the freeze's progress, then the image.
        // A form sent while Chromium sees the network change (see `wait_or`) may never reach
        // the manager: as a person would, send it again when no freeze was recorded.
        for attempt in 1..=3 {
            reload_if_network_changed(&browser).await;
            wait_for(&browser, "#freeze-session-button", Duration::from_secs(10)).await;
            fill(&browser, "#freeze-session", "train1").await;
            fill(&browser, "#freeze-tag", "mymodel:v1").await;
            click(&browser, "#freeze-session-button").await;
            let recorded = Instant::now();
            let mut images = Vec::new();
            while images.is_empty() && recorded.elapsed() < Duration::from_secs(5) {
                tokio::time::sleep(Duration::from_millis(200)).await;
                images = site
                    .devctl_json::<Vec<Value>>(&alice, &["image", "ls"])
                    .expect("image ls");
            }
            if !images.is_empty() {
                break;
            }
            assert!(attempt < 3, "the freeze form never reached the manager");
        }
        let started = Instant::now();
        let mut progress_seen = Vec::new();
        let mut shot_taken = false;
        loop {
            // Read in one script: a live update may replace the row between two WebDriver calls.
            let row = browser
                .execute(
                    r#"const r = document.querySelector('tr[data-image="mymodel:v1"]');
                       return r ? [r.getAttribute("data-state"), r.innerText] : null;"#,
                    Vec::new(),
                )
                .await
                .expect("read the image row");
            if let Some([state, text]) = row.as_array().map(|r| {
                [0, 1].map(|i| {
                    r.get(i)
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_owned()
                })
            }) {
                if state == "BUILDING" && text.contains(" of ") {
                    progress_seen.push(text.clone());
                    if !shot_taken {
                        screenshot(&browser, &shots, "dashboard-freeze.png").await;
                        shot_taken = true;
                    }
                }
                if state == "READY" {
                    assert!(
                        text.contains("ongrid/"),
                        "the Docker image is named: {text}"
                    );
                    break;
                }
                assert_ne!(state, "FAILED", "{text}\n{}", site.logs());
            }
            assert!(
                started.elapsed() < Duration::from_secs(300),
                "the freeze did not finish within 5 minutes\n{}",
                site.logs()
            );
            reload_if_network_changed(&browser).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            !progress_seen.is_empty(),
            "the page showed the freeze's progress (bytes done of total) before READY"
        );
        let image: Value = site
            .devctl_json(&alice, &["image", "show", "mymodel:v1"])
            .expect("image show");
        assert_eq!(image["state"], "READY");
        browser.close().await.expect("close Alice's browser");

        // Bob sees none of Alice's sessions or images, and no admin page.
        let bob_link = dashboard_link(&site, &bob);
        let bob_browser = driver.browser("bob").await;
        log_in(&bob_browser, &bob_link).await;
        let page = bob_browser.source().await.expect("Bob's page");
        assert!(!page.contains("train1"), "{page}");
        assert!(
            page.contains("No sessions.") && page.contains("No images yet."),
            "{page}"
        );
        for rows in [r#"tr[data-session]"#, r#"tr[data-image]"#] {
            let found = bob_browser
                .find_all(Locator::Css(rows))
                .await
                .expect("rows");
            assert!(
                found.is_empty(),
                "Bob sees {} of {rows}: {page}",
                found.len()
            );
        }
        bob_browser
            .goto(&format!("{base}/dashboard/admin"))
            .await
            .expect("admin page");
        let page = bob_browser.source().await.expect("refusal");
        assert!(page.contains("only admins"), "{page}");
        bob_browser.close().await.expect("close Bob's browser");

        // The admin sees Alice's session and adds an institute.
        let admin_link = dashboard_link(&site, &admin);
        let admin_browser = driver.browser("admin").await;
        log_in(&admin_browser, &admin_link).await;
        admin_browser
            .goto(&format!("{base}/dashboard/admin"))
            .await
            .expect("admin page");
        wait_for(
            &admin_browser,
            r#"tr[data-session="train1"]"#,
            Duration::from_secs(10),
        )
        .await;
        fill(&admin_browser, "#institute-name", "physics-lab").await;
        fill(
            &admin_browser,
            "#institute-networks",
            "192.0.2.0/24, 2001:db8::/32",
        )
        .await;
        click(&admin_browser, "#add-institute").await;
        wait_for(
            &admin_browser,
            r#"tr[data-institute="physics-lab"]"#,
            Duration::from_secs(10),
        )
        .await;
        let listed = site.devctl_ok(&admin, &["admin", "institute", "ls"]);
        assert!(
            listed.contains("physics-lab") && listed.contains("192.0.2.0/24"),
            "{listed}"
        );
        screenshot(&admin_browser, &shots, "dashboard-admin.png").await;
        admin_browser
            .close()
            .await
            .expect("close the admin's browser");
    });
    let leftovers = driver.browsers_left();
    drop(driver);
    assert!(
        leftovers.is_empty(),
        "closing the WebDriver sessions ends their browsers: {leftovers:?} were left"
    );
}
