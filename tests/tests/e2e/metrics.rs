//! Metrics with a real Prometheus server (Debian's `prometheus`): it scrapes the manager, the
//! agent and the gateway every second, and the test reads the series back through Prometheus'
//! HTTP API (`/api/v1/query`) after a session start, SSH logins (one refused, one accepted) and
//! a hold. Also the health endpoints every component serves beside `/metrics`.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use ongrid_e2e::{Process, SimGpu, Site};
use serde_json::Value;

/// A Prometheus server scraping the site, with its config and data in a temp dir.
struct Prometheus {
    _process: Process,
    _dir: tempfile::TempDir,
    address: String,
}

impl Prometheus {
    /// Starts Prometheus on a port of its choosing (`127.0.0.1:0`; it logs the bound address),
    /// scraping each of `targets` (job name, address) every second.
    fn start(site: &Site, targets: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut config =
            String::from("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n");
        for (job, address) in targets {
            config.push_str(&format!(
                "  - job_name: {job}\n    static_configs:\n      - targets: [\"{address}\"]\n"
            ));
        }
        let config_file = dir.path().join("prometheus.yml");
        std::fs::write(&config_file, config).expect("write prometheus.yml");
        let log = dir.path().join("prometheus.log");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config_file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg("--web.listen-address=127.0.0.1:0")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("create prometheus.log"))
            .spawn()
            .expect(
                "spawn prometheus: install Debian's prometheus (deploy/install-packages.sh tests)",
            );
        let process = Process::new(child, "prometheus");
        let address = site.wait_until(
            "Prometheus to log its address",
            Duration::from_secs(30),
            || listening_address(&log),
        );
        Self {
            _process: process,
            _dir: dir,
            address,
        }
    }

    /// The value of `query` (an expression of one series, such as a `sum(...)`), or `None` while
    /// it has no result.
    fn value(&self, query: &str) -> Option<f64> {
        let body = curl(&format!("http://{}/api/v1/query", self.address), &[query])?;
        let answer: Value = serde_json::from_str(&body).ok()?;
        assert_eq!(answer["status"], "success", "query {query}: {answer}");
        let results = answer["data"]["result"].as_array()?;
        assert!(
            results.len() <= 1,
            "query {query} has several series: {answer}"
        );
        results.first()?["value"][1].as_str()?.parse().ok()
    }

    /// Waits until `query`'s value satisfies `check`; returns it.
    fn wait(&self, site: &Site, query: &str, check: impl Fn(f64) -> bool) -> f64 {
        site.wait_until(
            &format!("Prometheus: {query}"),
            Duration::from_secs(30),
            || self.value(query).filter(|v| check(*v)),
        )
    }
}

/// The address in Prometheus' `msg="Listening on" address=ADDR` log line, once written.
fn listening_address(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines()
        .filter(|line| line.contains("msg=\"Listening on\""))
        .find_map(|line| line.split("address=").nth(1))
        .map(|address| address.trim().to_owned())
}

/// GETs `url` with curl (each of `query` URL-encoded as `query=`); the body of a 2xx answer.
fn curl(url: &str, query: &[&str]) -> Option<String> {
    let mut command = Command::new("curl");
    command.args(["-sS", "--fail", "--max-time", "5", "--get"]);
    for value in query {
        command
            .arg("--data-urlencode")
            .arg(format!("query={value}"));
    }
    let out = command.arg(url).output().expect("run curl");
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// HTTP status and body of a GET of `url`.
fn status_and_body(url: &str) -> (String, String) {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "5", "-w", "\n%{http_code}", url])
        .output()
        .expect("run curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, status) = text.rsplit_once('\n').expect("curl -w output");
    (status.to_owned(), body.to_owned())
}

#[test]
fn prometheus_scrapes_every_component_through_a_session_start_a_login_and_a_hold() {
    let mut site = Site::start_with_metrics(&[SimGpu::a100(1)]);
    site.allow_loopback();
    let alice = site.user("Alice");
    site.add_key(&alice);
    let bob = site.user("Bob");
    let addrs = site.metrics_addrs.clone();

    // Health for load balancers and systemd: alive, and ready (the manager's store answers;
    // the gateway has its allowlist; the agent's first sync reached Docker and the manager,
    // which may come just after its registration put the node online).
    site.wait_until(
        "the agent's /readyz to say ready",
        Duration::from_secs(30),
        || {
            let answer = status_and_body(&format!("http://{}/readyz", addrs["agent"]));
            (answer == ("200".to_owned(), "ready\n".to_owned())).then_some(())
        },
    );
    for component in ["manager", "agent", "gateway"] {
        let address = &addrs[component];
        assert_eq!(
            status_and_body(&format!("http://{address}/healthz")),
            ("200".to_owned(), "ok\n".to_owned()),
            "{component}"
        );
        assert_eq!(
            status_and_body(&format!("http://{address}/readyz")),
            ("200".to_owned(), "ready\n".to_owned()),
            "{component}"
        );
    }

    let prometheus = Prometheus::start(
        &site,
        &[
            ("ongrid-manager", &addrs["manager"]),
            ("ongrid-agent", &addrs["agent"]),
            ("ongrid-gateway", &addrs["gateway"]),
        ],
    );
    prometheus.wait(&site, "sum(up{job=~\"ongrid-.*\"})", |up| up == 3.0);
    prometheus.wait(
        &site,
        "sum(ongrid_gpus{use=\"free\",health=\"healthy\"})",
        |n| n == 1.0,
    );
    assert_eq!(prometheus.value("sum(ongrid_session_holds_total)"), None);

    // A session starts: counted by state, its GPU used, the time to running observed, its
    // container created by the agent, the request counted by its route template.
    site.devctl_ok(&alice, &["session", "new", "--name", "watched", "--wait"]);
    prometheus.wait(&site, "ongrid_sessions{state=\"waiting\"}", |n| n == 1.0);
    prometheus.wait(
        &site,
        "sum(ongrid_gpus{use=\"used\",model=\"NVIDIA A100-SXM4-40GB\",mode=\"exclusive\"})",
        |n| n == 1.0,
    );
    prometheus.wait(&site, "ongrid_session_start_duration_seconds_count", |n| {
        n == 1.0
    });
    let started_in = prometheus.wait(&site, "ongrid_session_start_duration_seconds_sum", |s| {
        s > 0.0
    });
    assert!(started_in < 60.0, "time to running {started_in} s");
    prometheus.wait(
        &site,
        "sum(ongrid_http_requests_total{route=\"/v1/sessions\",method=\"POST\",status=\"201\"})",
        |n| n >= 1.0,
    );
    prometheus.wait(
        &site,
        "sum(ongrid_agent_container_operation_duration_seconds_count{operation=\"create\",result=\"ok\"})",
        |n| n >= 1.0,
    );
    prometheus.wait(
        &site,
        "sum(ongrid_agent_gpu_discovery_duration_seconds_count{backend=\"simulated\"})",
        |n| n >= 1.0,
    );

    // A key nobody registered is refused; a registered one logs in and runs a command.
    site.wait_until("ssh as alice to succeed", Duration::from_secs(20), || {
        let out = site.ssh(&alice, "watched", "printf 0123456789", b"");
        out.status.success().then_some(out)
    });
    let refused = site.ssh(&bob, "watched", "true", b"");
    assert!(!refused.status.success());
    prometheus.wait(
        &site,
        "sum(ongrid_gateway_refusals_total{reason=\"key\"})",
        |n| n >= 1.0,
    );
    prometheus.wait(&site, "ongrid_gateway_connections_total", |n| n >= 2.0);
    prometheus.wait(
        &site,
        "sum(ongrid_gateway_channels_total{type=\"exec\"})",
        |n| n >= 1.0,
    );
    prometheus.wait(&site, "ongrid_gateway_sent_bytes_total", |n| n >= 10.0);
    prometheus.wait(&site, "ongrid_gateway_auth_duration_seconds_count", |n| {
        n >= 1.0
    });
    prometheus.wait(&site, "ongrid_gateway_connections_open", |n| n == 0.0);

    // The owner holds it: counted by reason, the session HELD, its GPU free again, its
    // container stopped.
    site.devctl_ok(&alice, &["session", "hold", "watched"]);
    prometheus.wait(&site, "ongrid_session_holds_total{reason=\"owner\"}", |n| {
        n == 1.0
    });
    prometheus.wait(&site, "ongrid_sessions{state=\"held\"}", |n| n == 1.0);
    prometheus.wait(&site, "ongrid_sessions{state=\"waiting\"}", |n| n == 0.0);
    prometheus.wait(&site, "sum(ongrid_gpus{use=\"free\"})", |n| n == 1.0);
    assert_eq!(prometheus.value("sum(ongrid_gpus{use=\"used\"})"), None);
    prometheus.wait(
        &site,
        "sum(ongrid_agent_container_operation_duration_seconds_count{operation=\"stop\",result=\"ok\"})",
        |n| n >= 1.0,
    );
    assert_eq!(
        prometheus.value("sum(ongrid_session_holds_total)"),
        Some(1.0)
    );
}
