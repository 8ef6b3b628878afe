//! The web dashboard in a real browser: headless Chromium driven through chromedriver
//! (WebDriver, the fantoccini client) against the real manager, agent and Docker. A user logs
//! in with the link `devctl dashboard` prints, starts a session and sees it running, holds and
//! releases it, freezes it and sees the freeze's progress; a second user sees none of it; an
//! admin adds an institute. Every page change the test waits for arrives by the page's live
//! updates or its own form posts, never by the test reloading.
//!
//! The browser is `super::browser`'s. Screenshots of the user and admin pages go to the test's directory, or to
//! `$ONGRID_DASHBOARD_SCREENSHOTS` when set (README's come from there).

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use fantoccini::Locator;
use ongrid_e2e::{SimGpu, Site, User};
use serde_json::Value;

use super::browser::{click, fill, log_in, screenshot, text_of, wait_for, wait_or, Driver};

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
    let driver = Driver::start(&site);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        // Alice logs in with her link; it works once.
        let link = dashboard_link(&site, &alice);
        let base = link[..link.find("/dashboard/").expect("a dashboard path")].to_owned();
        let browser = driver.browser("alice").await;
        log_in(&browser, &link, "#start-session").await;
        browser.goto(&link).await.expect("open the page");
        let page = browser.source().await.expect("page");
        assert!(page.contains("used already or has expired"), "{page}");
        browser
            .goto(&format!("{base}/dashboard/"))
            .await
            .expect("open the page");

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
        wait_for(&browser, "#freeze-session-button", Duration::from_secs(10)).await;
        fill(&browser, "#freeze-session", "train1").await;
        fill(&browser, "#freeze-tag", "mymodel:v1").await;
        click(&browser, "#freeze-session-button").await;
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
        log_in(&bob_browser, &bob_link, "#start-session").await;
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
            .expect("open the page");
        let page = bob_browser.source().await.expect("refusal");
        assert!(page.contains("only admins"), "{page}");
        bob_browser.close().await.expect("close Bob's browser");

        // The admin sees Alice's session and adds an institute.
        let admin_link = dashboard_link(&site, &admin);
        let admin_browser = driver.browser("admin").await;
        log_in(&admin_browser, &admin_link, "#start-session").await;
        admin_browser
            .goto(&format!("{base}/dashboard/admin"))
            .await
            .expect("open the page");
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
