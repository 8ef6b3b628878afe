//! A real browser for the end-to-end tests: headless Chromium driven through chromedriver
//! (WebDriver, the fantoccini client), and the steps the browser tests share.
//!
//! [`Driver`] starts chromedriver itself (on a port it picks, `--port=0`) in its own process
//! group and kills that group, and any Chromium left with the test's profile directory, when it
//! is dropped, pass or fail.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::json;

/// chromedriver and the Chromiums it starts; all killed when dropped.
pub struct Driver {
    child: Child,
    port: u16,
    /// The profile directories of the browsers, unique to this test.
    profiles: tempfile::TempDir,
}

impl Driver {
    pub fn start() -> Self {
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
    pub async fn browser(&self, name: &str) -> Client {
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
    pub fn browsers_left(&self) -> Vec<u32> {
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

/// Waits until `css` matches an element (the page's live updates bring it).
pub async fn wait_for(client: &Client, css: &str, within: Duration) {
    wait_or(client, css, within, String::new).await
}

/// [`wait_for`], with `diagnose` saying what else to show when it does not come.
///
/// Chromium drops what it has in flight when the host's network changes, and Docker changes it
/// whenever a dev container starts (a bridge, a veth): the page is then Chromium's own error
/// page (ERR_NETWORK_CHANGED). The page is opened again then, as a person would reload it.
pub async fn wait_or(
    client: &Client,
    css: &str,
    within: Duration,
    diagnose: impl FnOnce() -> String,
) {
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
pub async fn reload_if_network_changed(client: &Client) {
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
        // A session's web app is opened again where it was; a dashboard page at its home.
        let again = if url.path().starts_with("/dashboard/sessions/") {
            url.clone()
        } else if url.path().starts_with("/dashboard/admin") {
            url.join("/dashboard/admin").expect("a dashboard URL")
        } else {
            url.join("/dashboard/").expect("a dashboard URL")
        };
        client
            .goto(again.as_str())
            .await
            .expect("open the page again");
    }
}

/// Opens `url`, again while Chromium shows its own error page for it instead (other tests
/// start containers meanwhile, and Docker changing the host's network makes Chromium drop the
/// request: `ERR_NETWORK_CHANGED`). For a page read at once; [`wait_for`] does the same while
/// it waits.
pub async fn open(client: &Client, url: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        client.goto(url).await.expect("open the page");
        if !shows_network_error(client).await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{url} showed Chromium's network error page for 30 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether the page is Chromium's own error page for a request it dropped.
async fn shows_network_error(client: &Client) -> bool {
    client
        .execute(
            "return !!(document.body && document.body.classList.contains('neterror'));",
            Vec::new(),
        )
        .await
        .ok()
        .and_then(|v| v.as_bool())
        .unwrap_or(false)
}

/// Opens a login link and presses its button; then waits for `then` (the page the link leads
/// to).
pub async fn log_in(client: &Client, link: &str, then: &str) {
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
        if shows_network_error(client).await {
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
    wait_for(client, then, Duration::from_secs(60)).await;
}

pub async fn fill(client: &Client, css: &str, text: &str) {
    let input = client.find(Locator::Css(css)).await.expect(css);
    input.clear().await.expect("clear");
    input.send_keys(text).await.expect("type");
}

/// Clicks `css`, looking again if a live update replaced the element meanwhile.
pub async fn click(client: &Client, css: &str) {
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
pub async fn text_of(client: &Client, css: &str) -> String {
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

pub async fn screenshot(client: &Client, dir: &Path, name: &str) {
    let png = client.screenshot().await.expect("screenshot");
    assert!(png.starts_with(b"\x89PNG"), "a PNG");
    std::fs::create_dir_all(dir).expect("screenshot directory");
    std::fs::write(dir.join(name), png).expect("write screenshot");
}
