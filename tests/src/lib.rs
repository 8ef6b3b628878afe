//! Harness for ongrid's end-to-end tests: a throwaway PKI, the real `ongrid-manager`,
//! `ongrid-agent` and `devctl` binaries as child processes, and the real Docker daemon (through
//! the `docker` CLI, so this crate never links a Docker client library).
//!
//! Every [`Site`] is isolated: its own temporary directory, database, node name and user names,
//! so tests run in parallel against one Docker daemon. Dropping a site stops its processes and
//! removes every container and home volume it created, also when the test failed. A test that
//! stops or restarts Docker runs its site on a daemon of its own ([`dockerd::TestDockerd`],
//! [`Site::start_on`]), never on the machine's. A site may run two manager replicas on a
//! PostgreSQL server of its own ([`Site::start_replicated`], [`postgres::Postgres`]), with the
//! agent, the gateway and devctl given both.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use ongrid_agent::network::iptables::Iptables;
use ongrid_agent::network::NetworkPolicy;
use ongrid_core::NodeName;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};
use serde::de::DeserializeOwned;
use serde_json::Value;

/// Writes a file only its owner may read: devctl refuses a key or config file others may read.
pub fn write_private(path: &Path, contents: impl AsRef<[u8]>) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, contents)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
}

pub mod cluster;
pub mod docker;
pub mod dockerd;
pub mod postgres;

#[cfg(test)]
mod architecture;

use docker::docker_on;
pub use docker::{
    docker_exec, docker_lines, docker_lines_on, inspect_container, inspect_container_on,
    unique_suffix, DEV_IMAGE,
};

/// The `[metrics]` table of every component of a [`Site::start_with_metrics`] site.
const METRICS_SECTION: &str = "\n[metrics]\nlisten = \"127.0.0.1:0\"\n";

/// The OID of domainComponent (DC), which rcgen has no short name for.
const DOMAIN_COMPONENT: [u64; 7] = [0, 9, 2342, 19_200_300, 100, 1, 25];

/// Directory holding the workspace's built binaries: the parent of this test executable's
/// `deps/` directory, which is `target/<profile>/` for `cargo test`.
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("path of the test executable");
    let deps = exe.parent().expect("test executable has a directory");
    deps.parent()
        .expect("deps directory has a parent")
        .to_path_buf()
}

/// The path of one of the workspace binaries, which must have been built.
pub fn binary(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    assert!(
        path.exists(),
        "{} is missing: build the workspace first with `cargo build --workspace --bins` \
         (./scripts/test does)",
        path.display()
    );
    path
}

/// The log filter a started binary gets: `default`, with the directives of `ONGRID_E2E_LOG`
/// after it when set (the harness waits for lines the default logs).
pub(crate) fn log_filter_of(default: &str) -> String {
    match std::env::var("ONGRID_E2E_LOG") {
        Ok(more) if !more.is_empty() => format!("{default},{more}"),
        _ => default.to_owned(),
    }
}

/// Fails loudly when Docker or the dev image is missing: these tests never skip.
pub fn require_docker() {
    let out = Command::new("docker")
        .args(["version", "--format", "{{.Server.Version}}"])
        .output();
    match out {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "the end-to-end tests need a running Docker daemon: `docker version` failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => panic!("the end-to-end tests need the docker CLI and a running daemon: {e}"),
    }
    let image = Command::new("docker")
        .args(["image", "inspect", "--format", "{{.Id}}", DEV_IMAGE])
        .output()
        .expect("run docker image inspect");
    assert!(
        image.status.success(),
        "the dev image {DEV_IMAGE} is missing: build it with images/dev/build.sh"
    );
}

/// A throwaway certificate authority laid out like /etc/grid-security/certificates.
pub struct Pki {
    pub ca_dir: PathBuf,
    dir: PathBuf,
    ca_cert: rcgen::Certificate,
    ca_key: KeyPair,
}

/// A certificate and key on disk, with the DN the manager will see.
#[derive(Debug, Clone)]
pub struct Credentials {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub dn: String,
}

/// `/DC=org/O=<org>/CN=<cn>`. (rcgen keeps one value per attribute type, so a DN with two DCs
/// cannot be made with it.)
fn grid_dn(org: &str, cn: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    let dc = rcgen::DnValue::Ia5String("org".try_into().expect("ascii"));
    dn.push(DnType::CustomDnType(DOMAIN_COMPONENT.to_vec()), dc);
    dn.push(DnType::OrganizationName, org);
    dn.push(DnType::CommonName, cn);
    dn
}

impl Pki {
    pub fn new(dir: &Path) -> anyhow::Result<Self> {
        let ca_dir = dir.join("certificates");
        std::fs::create_dir_all(&ca_dir)?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name = grid_dn("ongrid-test", "ongrid test CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(1));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_key = KeyPair::generate()?;
        let ca_cert = params.self_signed(&ca_key)?;
        // The IGTF layout names CA files `<8-hex subject hash>.0`, as real CA directories do.
        std::fs::write(ca_dir.join("0e2e0e2e.0"), ca_cert.pem())?;
        Ok(Self {
            ca_dir,
            dir: dir.to_path_buf(),
            ca_cert,
            ca_key,
        })
    }

    fn issue(
        &self,
        file_stem: &str,
        params: CertificateParams,
    ) -> anyhow::Result<(PathBuf, PathBuf)> {
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.ca_cert, &self.ca_key)?;
        let cert_path = self.dir.join(format!("{file_stem}.crt"));
        let key_path = self.dir.join(format!("{file_stem}.key"));
        std::fs::write(&cert_path, cert.pem())?;
        write_private(&key_path, key.serialize_pem())?;
        Ok((cert_path, key_path))
    }

    /// A user certificate for `/DC=org/O=ongrid-test/CN=<cn>`.
    pub fn user(&self, cn: &str) -> anyhow::Result<Credentials> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name = grid_dn("ongrid-test", cn);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let stem = format!("user-{}", cn.to_lowercase().replace(' ', "-"));
        let (cert, key) = self.issue(&stem, params)?;
        Ok(Credentials {
            cert,
            key,
            dn: format!("/DC=org/O=ongrid-test/CN={cn}"),
        })
    }

    /// The manager's server certificate, valid for 127.0.0.1 and localhost.
    pub fn server(&self) -> anyhow::Result<Credentials> {
        let mut params = CertificateParams::new(vec!["localhost".to_owned()])?;
        params
            .subject_alt_names
            .push(SanType::IpAddress("127.0.0.1".parse()?));
        params.distinguished_name = grid_dn("ongrid-test", "localhost");
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let (cert, key) = self.issue("manager", params)?;
        Ok(Credentials {
            cert,
            key,
            dn: "/DC=org/O=ongrid-test/CN=localhost".to_owned(),
        })
    }
}

/// A grid CA made by `x509/scripts/gridca.sh`: real grid user certificates (openssl) and RFC 3820
/// proxies made by `grid-proxy-init`, as users have them, for the identity tests.
#[derive(Debug, Clone)]
pub struct GridCa {
    /// gridca.sh's OUTDIR: `certificates/`, `users/NAME/`, ...
    pub dir: PathBuf,
}

impl GridCa {
    /// The script, in the x509 crate.
    pub fn script() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../x509/scripts/gridca.sh")
    }

    /// Runs `gridca.sh ARGS` (the OUTDIR is given by the caller).
    pub fn run(env: &[(&str, &str)], args: &[&str]) -> anyhow::Result<()> {
        let out = Command::new(Self::script())
            .args(args)
            .envs(env.iter().copied())
            .output()
            .context("run x509/scripts/gridca.sh (needs openssl and globus-proxy-utils)")?;
        if !out.status.success() {
            bail!(
                "gridca.sh {} failed: {}{}",
                args.join(" "),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// A new CA in `dir`, `/DC=org/DC=ongrid-test/CN=<cn>` (default `ongrid test CA`; two CAs
    /// need two names).
    pub fn create(dir: &Path, cn: Option<&str>) -> anyhow::Result<Self> {
        let dir_text = dir.display().to_string();
        let mut args = vec!["ca", dir_text.as_str()];
        args.extend(cn);
        Self::run(&[], &args)?;
        Ok(Self {
            dir: dir.to_path_buf(),
        })
    }

    /// The CA's IGTF directory (`<hash>.0`, `<hash>.r0`).
    pub fn certificates(&self) -> PathBuf {
        self.dir.join("certificates")
    }

    /// A user certificate `/DC=org/DC=ongrid-test/OU=People/CN=<name>`; returns its directory
    /// (`usercert.pem`, `userkey.pem`).
    pub fn user(&self, name: &str) -> anyhow::Result<PathBuf> {
        Self::run(&[], &["user", &self.dir.display().to_string(), name])?;
        Ok(self.dir.join("users").join(name))
    }

    /// `grid-proxy-init -rfc` for user `name` (or a proxy of the proxy file `name`) into `out`,
    /// with more grid-proxy-init flags such as `-valid 0:1`, `-limited`, `-old`.
    pub fn proxy(&self, name: &str, out: &Path, flags: &[&str]) -> anyhow::Result<PathBuf> {
        let dir = self.dir.display().to_string();
        let out_text = out.display().to_string();
        let mut args = vec!["proxy", dir.as_str(), name, out_text.as_str()];
        args.extend_from_slice(flags);
        Self::run(&[], &args)?;
        Ok(out.to_path_buf())
    }

    /// Installs this CA (certificate and CRL) into another CA directory.
    pub fn install_into(&self, ca_dir: &Path) -> anyhow::Result<()> {
        for entry in std::fs::read_dir(self.certificates())? {
            let path = entry?.path();
            if let Some(name) = path.file_name() {
                std::fs::copy(&path, ca_dir.join(name))?;
            }
        }
        Ok(())
    }
}

/// A simulated GPU for the agent's `simulated` backend.
#[derive(Debug, Clone)]
pub struct SimGpu {
    pub uuid: String,
    pub model: &'static str,
    pub capability: &'static str,
    pub memory: &'static str,
}

impl SimGpu {
    /// An A100 40GB whose UUID ends in `n`.
    pub fn a100(n: u8) -> Self {
        Self {
            uuid: format!("GPU-a100a100-0000-4000-8000-0000000000{n:02x}"),
            model: "NVIDIA A100-SXM4-40GB",
            capability: "8.0",
            memory: "40960MiB",
        }
    }

    /// An H100 80GB whose UUID ends in `n`.
    pub fn h100(n: u8) -> Self {
        Self {
            uuid: format!("GPU-b100b100-0000-4000-8000-0000000000{n:02x}"),
            model: "NVIDIA H100 80GB HBM3",
            capability: "9.0",
            memory: "81559MiB",
        }
    }
}

/// A user of the site: credentials and a devctl config pointing at the manager.
#[derive(Debug, Clone)]
pub struct User {
    pub creds: Credentials,
    pub devctl_config: PathBuf,
    /// An ed25519 SSH key pair made for this user (`<path>` and `<path>.pub`); not registered
    /// until the test runs `devctl key add`.
    pub ssh_key: PathBuf,
}

/// One isolated ongrid site: manager, one agent, users.
pub struct Site {
    pub dir: tempfile::TempDir,
    pub pki: Pki,
    pub node: String,
    pub manager_addr: Option<String>,
    /// The second manager replica's address, on a site started with
    /// [`Site::start_replicated`].
    pub manager2_addr: Option<String>,
    /// The SSH gateway's address, once started.
    pub gateway_addr: Option<String>,
    pub admin: User,
    manager: Option<Process>,
    manager2: Option<Process>,
    /// The managers' database server, on a site started with [`Site::start_replicated`].
    postgres: Option<postgres::Postgres>,
    agent: Option<Process>,
    gateway: Option<Process>,
    suffix: String,
    users: Vec<User>,
    /// Lines added to the agent's `[images]` table (see [`Site::start_configured`]).
    agent_images: String,
    /// Whether the manager, the agent and the gateway serve `[metrics]` (see
    /// [`Site::start_with_metrics`]).
    metrics: bool,
    /// The `metrics on ADDR` of each component (`manager`, `agent`, `gateway`), once started.
    pub metrics_addrs: BTreeMap<String, String>,
    /// The Docker daemon of the agent when it is not the machine's (see [`Site::start_on`]).
    docker: Option<dockerd::AgentDocker>,
}

impl Site {
    /// Like [`Site::start`], with `[metrics] listen = "127.0.0.1:0"` on the manager, the agent
    /// and the gateway; their addresses are in [`Site::metrics_addrs`].
    pub fn start_with_metrics(gpus: &[SimGpu]) -> Self {
        require_docker();
        let mut site = Self::prepare(gpus).expect("prepare the site's files");
        site.metrics = true;
        let path = site.dir.path().join("manager.toml");
        let mut text = std::fs::read_to_string(&path).expect("read manager config");
        text.push_str(METRICS_SECTION);
        std::fs::write(&path, text).expect("write manager config");
        site.start_manager();
        site.start_agent();
        site.wait_for_node();
        site.start_gateway();
        site
    }

    /// Only a manager, with `[metrics]` on, the top-level `settings` of its config replaced
    /// (`("sync_interval", "\"5 seconds\"")`), `manager_extra` appended (whole tables), and
    /// `agent_tokens` (lines `<node> <token>`) added to its agent tokens file: for a benchmark
    /// that speaks the agent protocol itself, for nodes it simulates. No Docker.
    pub fn start_manager_only(
        settings: &[(&str, &str)],
        manager_extra: &str,
        agent_tokens: &str,
    ) -> Self {
        let mut site = Self::manager_only(settings, manager_extra, agent_tokens);
        site.start_manager();
        site
    }

    /// Like [`Site::start_manager_only`], with two manager replicas on one PostgreSQL database
    /// of the site's own, as [`Site::start_replicated`] starts them.
    pub fn start_replicas_only(
        settings: &[(&str, &str)],
        manager_extra: &str,
        agent_tokens: &str,
    ) -> Self {
        let mut site = Self::manager_only(settings, manager_extra, agent_tokens);
        site.start_replicas();
        site
    }

    /// The files of [`Site::start_manager_only`], nothing started.
    fn manager_only(settings: &[(&str, &str)], manager_extra: &str, agent_tokens: &str) -> Self {
        let mut site = Self::prepare(&[]).expect("prepare the site's files");
        site.metrics = true;
        let path = site.dir.path().join("manager.toml");
        let text = std::fs::read_to_string(&path).expect("read manager config");
        let mut text: String = text
            .lines()
            .map(|line| {
                let key = line.split(" = ").next().unwrap_or_default();
                match settings.iter().find(|(k, _)| *k == key) {
                    Some((key, value)) => format!("{key} = {value}\n"),
                    None => format!("{line}\n"),
                }
            })
            .collect();
        text.push_str(METRICS_SECTION);
        text.push('\n');
        text.push_str(manager_extra);
        text.push('\n');
        std::fs::write(&path, text).expect("write manager config");
        let tokens = site.dir.path().join("agent-tokens");
        let mut text = std::fs::read_to_string(&tokens).expect("read agent tokens");
        text.push_str(agent_tokens);
        write_private(&tokens, text).expect("write agent tokens");
        site
    }

    /// Starts a manager and an agent with the given simulated GPUs.
    pub fn start(gpus: &[SimGpu]) -> Self {
        require_docker();
        let site = Self::prepare(gpus).expect("prepare the site's files");
        let mut site = site;
        site.start_manager();
        site.start_agent();
        site.wait_for_node();
        site.start_gateway();
        site
    }

    /// Like [`Site::start`], with the agent on a Docker daemon of the test's own instead of
    /// the machine's; the site's [`Drop`] removes its containers from that daemon.
    pub fn start_on(gpus: &[SimGpu], dockerd: &dockerd::TestDockerd) -> Self {
        let mut site = Self::prepare(gpus).expect("prepare the site's files");
        site.docker = Some(dockerd.agent());
        site.start_manager();
        site.start_agent();
        site.wait_for_node();
        site.start_gateway();
        site
    }

    /// Like [`Site::start`], with the manager's `[lifecycle]` section set to `lifecycle` (TOML
    /// lines such as `connect_deadline = "6s"`), so that holds happen within seconds.
    pub fn start_with_lifecycle(gpus: &[SimGpu], lifecycle: &str) -> Self {
        require_docker();
        let mut site = Self::prepare(gpus).expect("prepare the site's files");
        let path = site.dir.path().join("manager.toml");
        let mut text = std::fs::read_to_string(&path).expect("read manager config");
        text.push_str("\n[lifecycle]\n");
        text.push_str(lifecycle);
        text.push('\n');
        std::fs::write(&path, text).expect("write manager config");
        site.start_manager();
        site.start_agent();
        site.wait_for_node();
        site.start_gateway();
        site
    }

    /// Like [`Site::start`], with `manager` appended to the manager's config (whole tables, like
    /// `[jobs]\nmax_duration = "6s"`) and `agent_images` lines added to the agent's `[images]`
    /// table (like `job_halt_grace = "2s"`), so that time-based rules act within seconds.
    pub fn start_configured(gpus: &[SimGpu], manager: &str, agent_images: &str) -> Self {
        require_docker();
        let mut site = Self::prepare(gpus).expect("prepare the site's files");
        let path = site.dir.path().join("manager.toml");
        let mut text = std::fs::read_to_string(&path).expect("read manager config");
        text.push('\n');
        text.push_str(manager);
        text.push('\n');
        std::fs::write(&path, text).expect("write manager config");
        site.agent_images = agent_images.to_owned();
        site.start_manager();
        site.start_agent();
        site.wait_for_node();
        site.start_gateway();
        site
    }

    /// Like [`Site::start`], with a grid CA ([`Site::grid`]) that the manager trusts next to the
    /// harness's own, for users with real grid certificates and proxies ([`Site::grid_user`]).
    pub fn start_grid(gpus: &[SimGpu]) -> Self {
        require_docker();
        let mut site = Self::prepare(gpus).expect("prepare the site's files");
        let grid = GridCa::create(&site.dir.path().join("grid"), None).expect("make the grid CA");
        grid.install_into(&site.pki.ca_dir)
            .expect("install the grid CA");
        site.start_manager();
        site.start_agent();
        site.wait_for_node();
        site.start_gateway();
        site
    }

    /// Like [`Site::start`], with two manager replicas on one PostgreSQL database (a server of
    /// the site's own): the first leads (it takes the database's manager lock first), and the
    /// agent, the gateway and devctl are given both URLs, the first first
    /// ([`Site::manager2_addr`]).
    pub fn start_replicated(gpus: &[SimGpu]) -> Self {
        require_docker();
        let mut site = Self::prepare(gpus).expect("prepare the site's files");
        site.start_replicas();
        site.start_agent();
        site.wait_for_node();
        site.start_gateway();
        site
    }

    /// A PostgreSQL server of the site's own and two managers on it, the first leading; the
    /// devctl configs name both.
    fn start_replicas(&mut self) {
        let postgres = postgres::Postgres::start().expect("start PostgreSQL for the managers");
        let path = self.dir.path().join("manager.toml");
        let text = std::fs::read_to_string(&path).expect("read manager config");
        let sqlite = format!(
            "database = \"{}\"",
            self.dir.path().join("manager.db").display()
        );
        assert!(text.contains(&sqlite), "{text}");
        // The replicas share the jobs' output directory, as on shared storage.
        let text = text.replace(&sqlite, &format!("database = \"{}\"", postgres.url))
            + &format!(
                "\n[jobs]\nlog_dir = \"{}\"\n",
                self.dir.path().join("jobs").display()
            );
        std::fs::write(&path, &text).expect("write manager config");
        let second = self.dir.path().join("manager2.toml");
        std::fs::write(&second, &text).expect("write the second manager's config");
        self.postgres = Some(postgres);
        self.start_manager();
        // The first leads before the second starts, so the second follows: started at once,
        // either could take the lead first.
        self.wait_until("the first replica to lead", Duration::from_secs(30), || {
            std::fs::read_to_string(self.dir.path().join("manager.log"))
                .ok()?
                .contains("Leading")
                .then_some(())
        });
        let (child, addr) = self.spawn_listening_as(
            "ongrid-manager",
            "manager2",
            &second,
            "info,ongrid_manager=debug",
        );
        self.manager2 = Some(child);
        self.manager2_addr = Some(addr);
        let admin = self.admin.clone();
        self.write_devctl_config(&admin);
    }

    /// The grid CA of a site started with [`Site::start_grid`].
    pub fn grid(&self) -> GridCa {
        GridCa {
            dir: self.dir.path().join("grid"),
        }
    }

    /// A user of the grid CA, `CN=<first_name lower-case>-<suffix>` (login [`Site::login_of`]).
    /// `creds` are the user certificate and key; the devctl config names the manager and the CA
    /// directory but no certificate, so devctl finds a proxy as grid tools do
    /// (`X509_USER_PROXY`, `/tmp/x509up_u<uid>`): run it with [`Site::devctl_env`].
    pub fn grid_user(&mut self, first_name: &str) -> User {
        let name = self.login_of(first_name);
        let dir = self
            .grid()
            .user(&name)
            .expect("make a grid user certificate");
        let stem = first_name.to_lowercase();
        let user = User {
            devctl_config: self.dir.path().join(format!("devctl-{stem}.toml")),
            creds: Credentials {
                cert: dir.join("usercert.pem"),
                key: dir.join("userkey.pem"),
                dn: format!("/DC=org/DC=ongrid-test/OU=People/CN={name}"),
            },
            ssh_key: ssh_keygen(&self.dir.path().join(format!("ssh-{stem}"))).expect("ssh-keygen"),
        };
        let toml = format!(
            "manager_url = {}\nca_dir = \"{}\"\n",
            self.manager_url(),
            self.pki.ca_dir.display()
        );
        write_private(&user.devctl_config, toml).expect("write devctl config");
        self.users.push(user.clone());
        user
    }

    /// Runs devctl as `user` with extra environment variables (such as `X509_USER_PROXY`) on
    /// top of what [`Site::devctl`] sets.
    ///
    /// No bearer token of the machine's reaches it: `BEARER_TOKEN` and `BEARER_TOKEN_FILE` are
    /// unset and `XDG_RUNTIME_DIR` is the site's directory, unless `env` sets them.
    pub fn devctl_env(&self, user: &User, env: &[(&str, &Path)], args: &[&str]) -> Output {
        Command::new(binary("devctl"))
            .args(args)
            .env("ONGRID_DEVCTL_CONFIG", &user.devctl_config)
            .env_remove("ONGRID_MANAGER_URL")
            .env_remove("X509_USER_PROXY")
            .env_remove("X509_USER_CERT")
            .env_remove("X509_USER_KEY")
            .env_remove("X509_CERT_DIR")
            .env_remove("BEARER_TOKEN")
            .env_remove("BEARER_TOKEN_FILE")
            .env("XDG_RUNTIME_DIR", self.dir.path())
            .envs(env.iter().map(|(k, v)| (*k, *v)))
            .output()
            .expect("run devctl")
    }

    /// A user who connects with bearer tokens only: their devctl config names the manager and
    /// the CAs, no certificate (`creds` are made but never used).
    pub fn token_user(&mut self, first_name: &str) -> User {
        let user = self.user(first_name);
        let toml = format!(
            "manager_url = {}\nca_dir = \"{}\"\n",
            self.manager_url(),
            self.pki.ca_dir.display()
        );
        write_private(&user.devctl_config, toml).expect("write devctl config");
        user
    }

    fn prepare(gpus: &[SimGpu]) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new().prefix("ongrid-e2e-").tempdir()?;
        let pki = Pki::new(dir.path())?;
        let suffix = unique_suffix();
        let node = format!("e2e-{suffix}");
        let server = pki.server()?;
        let admin_creds = pki.user(&format!("Site Admin {suffix}"))?;
        let token = format!("token-{}", uuid::Uuid::new_v4().simple());
        std::fs::write(dir.path().join("agent-tokens"), format!("{node} {token}\n"))?;
        std::fs::write(dir.path().join("node-token"), format!("{token}\n"))?;
        let gateway_token = format!("gateway-{}", uuid::Uuid::new_v4().simple());
        std::fs::write(
            dir.path().join("gateway-token"),
            format!("{gateway_token}\n"),
        )?;

        let mut sim = String::new();
        for gpu in gpus {
            sim.push_str(&format!(
                "[[gpu]]\nuuid = \"{}\"\nmodel = \"{}\"\ncapability = \"{}\"\nmemory = \"{}\"\n\n",
                gpu.uuid, gpu.model, gpu.capability, gpu.memory
            ));
        }
        std::fs::write(dir.path().join("gpus.toml"), sim)?;

        let manager_toml = format!(
            r#"listen = "127.0.0.1:0"
database = "{db}"
tls_cert = "{cert}"
tls_key = "{key}"
ca_dir = "{ca}"
admins = ["{admin}"]
agent_tokens_file = "{tokens}"
gateway_token_file = "{gateway_token}"
default_image = "{image}"
first_uid = 20000
node_timeout = "10 seconds"
sync_interval = "1 second"
schedule_interval = "1 second"
image_store = "{images}"

[session_limits]
cpus = "1.5"
memory = "1GiB"
pids = 512
"#,
            db = dir.path().join("manager.db").display(),
            cert = server.cert.display(),
            key = server.key.display(),
            ca = pki.ca_dir.display(),
            admin = admin_creds.dn,
            tokens = dir.path().join("agent-tokens").display(),
            gateway_token = dir.path().join("gateway-token").display(),
            image = DEV_IMAGE,
            images = dir.path().join("images").display(),
        );
        std::fs::write(dir.path().join("manager.toml"), manager_toml)?;

        let admin = User {
            devctl_config: dir.path().join("devctl-admin.toml"),
            creds: admin_creds,
            ssh_key: ssh_keygen(&dir.path().join("ssh-admin"))?,
        };
        Ok(Self {
            dir,
            pki,
            node,
            manager_addr: None,
            manager2_addr: None,
            gateway_addr: None,
            admin,
            manager: None,
            manager2: None,
            postgres: None,
            agent: None,
            gateway: None,
            suffix,
            users: Vec::new(),
            agent_images: String::new(),
            metrics: false,
            metrics_addrs: BTreeMap::new(),
            docker: None,
        })
    }

    /// `manager_url` as the agent's, the gateway's and devctl's config write it: the manager's
    /// URL, or both replicas' (the first first).
    fn manager_url(&self) -> String {
        let first = self.manager_addr.as_deref().expect("manager started");
        match &self.manager2_addr {
            Some(second) => format!("[\"https://{first}\", \"https://{second}\"]"),
            None => format!("\"https://{first}\""),
        }
    }

    fn write_devctl_config(&self, user: &User) {
        let toml = format!(
            "manager_url = {}\ncert = \"{}\"\nkey = \"{}\"\nca_dir = \"{}\"\n",
            self.manager_url(),
            user.creds.cert.display(),
            user.creds.key.display(),
            self.pki.ca_dir.display()
        );
        write_private(&user.devctl_config, toml).expect("write devctl config");
    }

    /// A new user with a unique CN (so login names and home volumes never collide).
    pub fn user(&mut self, first_name: &str) -> User {
        let cn = format!("{first_name} {}", self.suffix);
        let creds = self.pki.user(&cn).expect("issue user certificate");
        let stem = first_name.to_lowercase();
        let user = User {
            devctl_config: self.dir.path().join(format!("devctl-{stem}.toml")),
            creds,
            ssh_key: ssh_keygen(&self.dir.path().join(format!("ssh-{stem}"))).expect("ssh-keygen"),
        };
        self.write_devctl_config(&user);
        self.users.push(user.clone());
        user
    }

    /// The login name the manager derives for a user made by [`Site::user`].
    pub fn login_of(&self, first_name: &str) -> String {
        format!("{}-{}", first_name.to_lowercase(), self.suffix)
    }

    /// Starts (or restarts) the manager on the same database; keeps its port after the first
    /// start so devctl configs stay valid.
    pub fn start_manager(&mut self) {
        let config = self.dir.path().join("manager.toml");
        if let Some(addr) = &self.manager_addr {
            let text = std::fs::read_to_string(&config).expect("read manager config");
            let text = text.replace("listen = \"127.0.0.1:0\"", &format!("listen = \"{addr}\""));
            std::fs::write(&config, text).expect("write manager config");
        }
        let (child, addr) =
            self.spawn_listening("ongrid-manager", &config, "info,ongrid_manager=debug");
        self.manager = Some(child);
        if self.manager_addr.is_none() {
            self.manager_addr = Some(addr);
            let admin = self.admin.clone();
            self.write_devctl_config(&admin);
        }
    }

    pub fn start_agent(&mut self) {
        let manager_url = self.manager_url();
        let config = self.dir.path().join("agent.toml");
        let toml = format!(
            r#"node_name = "{node}"
manager_url = {manager_url}
ca_dir = "{ca}"
token_file = "{token}"

[gpu]
backend = "simulated"
file = "{gpus}"

[images]
store = "{images}"
{images_extra}

[streams]
listen = "127.0.0.1:0"
tls_cert = "{cert}"
tls_key = "{key}"
gateway_token_file = "{gateway_token}"
"#,
            node = self.node,
            ca = self.pki.ca_dir.display(),
            token = self.dir.path().join("node-token").display(),
            gpus = self.dir.path().join("gpus.toml").display(),
            cert = self.dir.path().join("manager.crt").display(),
            key = self.dir.path().join("manager.key").display(),
            gateway_token = self.dir.path().join("gateway-token").display(),
            images = self.dir.path().join("images").display(),
            images_extra = self.agent_images,
        );
        let toml = if self.metrics {
            toml + METRICS_SECTION
        } else {
            toml
        };
        let toml = match &self.docker {
            Some(docker) => toml + &docker.config,
            None => toml,
        };
        std::fs::write(&config, toml).expect("write agent config");
        let mut command = Command::new(binary("ongrid-agent"));
        if let Some(docker) = &self.docker {
            command.env("DOCKER_HOST", &docker.host);
        }
        let mut child = command
            .arg("--config")
            .arg(&config)
            .env("TMPDIR", self.agent_tmp())
            .env("ONGRID_LOG", log_filter_of("info,ongrid_agent=debug"))
            .stdout(if self.metrics {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stderr(self.log_file("agent"))
            .spawn()
            .expect("spawn ongrid-agent");
        if self.metrics {
            let stdout = child.stdout.take().expect("stdout");
            let lines = self.announced_lines(stdout);
            self.read_metrics_addr("agent", &lines);
        }
        self.agent = Some(Process::new(child, "ongrid-agent"));
    }

    /// Starts (or restarts, on the same port and host keys) the SSH gateway.
    pub fn start_gateway(&mut self) {
        let manager_url = self.manager_url();
        let listen = self
            .gateway_addr
            .clone()
            .unwrap_or_else(|| "127.0.0.1:0".to_owned());
        let config = self.dir.path().join("gateway.toml");
        let toml = format!(
            r#"listen = "{listen}"
host_key_dir = "{keys}"
manager_url = {manager_url}
ca_dir = "{ca}"
token_file = "{token}"
allowlist_refresh = "1 second"
"#,
            keys = self.dir.path().join("gateway-keys").display(),
            ca = self.pki.ca_dir.display(),
            token = self.dir.path().join("gateway-token").display(),
        );
        let toml = if self.metrics {
            toml + METRICS_SECTION
        } else {
            toml
        };
        std::fs::write(&config, toml).expect("write gateway config");
        let (child, addr) =
            self.spawn_listening("ongrid-gateway", &config, "info,ongrid_gateway=debug");
        self.gateway = Some(child);
        self.gateway_addr = Some(addr);
    }

    pub fn stop_gateway(&mut self) {
        if let Some(child) = self.gateway.take() {
            terminate(child);
        }
    }

    /// Spawns a binary that prints `listening on ADDR` first on stdout; returns it and ADDR.
    fn spawn_listening(
        &mut self,
        binary_name: &str,
        config: &Path,
        log_filter: &str,
    ) -> (Process, String) {
        let log_name = binary_name.trim_start_matches("ongrid-").to_owned();
        self.spawn_listening_as(binary_name, &log_name, config, log_filter)
    }

    /// [`Site::spawn_listening`], logging to `<log_name>.log` with `log_filter` and the
    /// directives of `ONGRID_E2E_LOG` ([`log_filter_of`]: `sqlx::query=debug` logs every
    /// statement of the manager, to count what a run asks of its database).
    fn spawn_listening_as(
        &mut self,
        binary_name: &str,
        log_name: &str,
        config: &Path,
        log_filter: &str,
    ) -> (Process, String) {
        let mut child = Command::new(binary(binary_name))
            .arg("--config")
            .arg(config)
            .env("ONGRID_LOG", log_filter_of(log_filter))
            .stdout(Stdio::piped())
            .stderr(self.log_file(log_name))
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {binary_name}: {e}"));
        let stdout = child.stdout.take().expect("stdout");
        let child = Process::new(child, binary_name);
        let rx = self.announced_lines(stdout);
        let addr = self.announced(binary_name, &rx, "listening on ");
        if self.metrics {
            self.read_metrics_addr(log_name, &rx);
        }
        (child, addr)
    }

    /// The lines a child prints on stdout, read by a thread that drains the pipe to its end (so
    /// the child never blocks on a full pipe).
    fn announced_lines(&self, stdout: std::process::ChildStdout) -> mpsc::Receiver<String> {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // Nobody listens any more once the addresses are read.
                let _ = tx.send(line);
            }
        });
        rx
    }

    /// Reads the next line of `lines`, `metrics on ADDR`, into `metrics_addrs[component]`.
    fn read_metrics_addr(&mut self, component: &str, lines: &mpsc::Receiver<String>) {
        let addr = self.announced(&format!("ongrid-{component}"), lines, "metrics on ");
        self.metrics_addrs.insert(component.to_owned(), addr);
    }

    /// The address in the next line `binary` prints, `PREFIX ADDR`, within 30 s.
    fn announced(&self, binary: &str, lines: &mpsc::Receiver<String>, prefix: &str) -> String {
        let Ok(line) = lines.recv_timeout(Duration::from_secs(30)) else {
            panic!(
                "{binary} did not print `{prefix}ADDR` within 30 s\n{}",
                self.logs()
            );
        };
        line.strip_prefix(prefix)
            .unwrap_or_else(|| panic!("{binary} printed {line:?}, not `{prefix}ADDR`"))
            .trim()
            .to_owned()
    }

    /// Allows 127.0.0.0/8 and ::1 as institute `local`.
    ///
    /// With the gateway running, returns once the gateway took it: it refreshes its allowlist
    /// every second, and a login right after would otherwise be refused as from an unknown
    /// network. The gateway closes a connection from a network it does not know before any SSH
    /// byte, and greets one it knows with its SSH banner.
    pub fn allow_loopback(&self) {
        self.devctl_ok(
            &self.admin,
            &[
                "admin",
                "institute",
                "add",
                "local",
                "127.0.0.0/8",
                "::1/128",
            ],
        );
        if let (Some(_), Some(addr)) = (&self.gateway, &self.gateway_addr) {
            self.wait_until(
                "the gateway to take the new institute",
                Duration::from_secs(15),
                || greets(addr).then_some(()),
            );
        }
    }

    /// Registers the user's SSH key.
    pub fn add_key(&self, user: &User) {
        let public = format!("{}.pub", user.ssh_key.display());
        self.devctl_ok(user, &["key", "add", &public]);
    }

    /// An `ssh` command to the gateway as `user`, logging in as `target`.
    pub fn ssh_command(&self, user: &User, target: &str) -> Command {
        let mut cmd = Command::new("ssh");
        cmd.args(self.ssh_options(user))
            .arg(format!("{target}@127.0.0.1"));
        cmd
    }

    /// The options that make OpenSSH use `user`'s key against this site's gateway, and nothing
    /// of the machine's own configuration.
    pub fn ssh_options(&self, user: &User) -> Vec<String> {
        let addr = self.gateway_addr.as_deref().expect("gateway started");
        let port = addr.rsplit(':').next().expect("port");
        ssh_client_options(port, &user.ssh_key)
    }

    /// Runs `ssh target@gateway command` as `user`, with `stdin` as its input.
    pub fn ssh(&self, user: &User, target: &str, command: &str, stdin: &[u8]) -> Output {
        use std::io::Write;
        let mut child = self
            .ssh_command(user, target)
            .arg(command)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run ssh");
        let mut input = child.stdin.take().expect("ssh stdin");
        let data = stdin.to_vec();
        let writer = std::thread::spawn(move || {
            let _ = input.write_all(&data);
        });
        let out = child.wait_with_output().expect("wait for ssh");
        let _ = writer.join();
        out
    }

    /// The temporary directory (`TMPDIR`) of the site's agents, in the test's own directory: an
    /// agent stopped by SIGKILL at the test's end leaves its runc process files
    /// (`ongrid-exec-*`) behind, which go with the test's directory instead of staying in /tmp.
    pub(crate) fn agent_tmp(&self) -> PathBuf {
        let dir = self.dir.path().join("agent-tmp");
        std::fs::create_dir_all(&dir).expect("make the agents' temporary directory");
        dir
    }

    fn log_file(&self, name: &str) -> std::fs::File {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("{name}.log")))
            .expect("open log file")
    }

    /// The tail of every log of the site's processes (manager, gateway, each agent), for
    /// failure messages.
    pub fn logs(&self) -> String {
        let mut logs: Vec<PathBuf> = std::fs::read_dir(self.dir.path())
            .map(|entries| {
                entries
                    .filter_map(|entry| Some(entry.ok()?.path()))
                    .filter(|path| path.extension().is_some_and(|e| e == "log"))
                    .collect()
            })
            .unwrap_or_default();
        logs.sort();
        let mut out = String::new();
        for path in logs {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(40)..];
            out.push_str(&format!(
                "--- last lines of {} ---\n{}\n",
                path.display(),
                tail.join("\n")
            ));
        }
        out
    }

    /// Stops the manager with SIGTERM and waits for it to exit.
    pub fn stop_manager(&mut self) {
        if let Some(child) = self.manager.take() {
            terminate(child);
        }
    }

    pub fn stop_agent(&mut self) {
        if let Some(child) = self.agent.take() {
            terminate(child);
        }
    }

    /// Kills the manager with SIGKILL (no graceful shutdown: a crash) and reaps it; panics if it
    /// had already exited. [`Site::start_manager`] starts it again on the same port and database.
    pub fn kill_manager(&mut self) {
        self.manager.take().expect("the manager runs").kill_hard();
    }

    /// Kills the agent with SIGKILL and reaps it; [`Site::start_agent`] starts it again.
    pub fn kill_agent(&mut self) {
        self.agent.take().expect("the agent runs").kill_hard();
    }

    /// Kills the gateway with SIGKILL and reaps it; [`Site::start_gateway`] starts it again on
    /// the same address and host keys.
    pub fn kill_gateway(&mut self) {
        self.gateway.take().expect("the gateway runs").kill_hard();
    }

    /// The process id of a running component: `manager`, `agent` or `gateway`.
    pub fn pid(&self, component: &str) -> Option<u32> {
        let process = match component {
            "manager" => self.manager.as_ref(),
            "manager2" => self.manager2.as_ref(),
            "agent" => self.agent.as_ref(),
            "gateway" => self.gateway.as_ref(),
            _ => None,
        }?;
        process.child.as_ref().map(Child::id)
    }

    /// The URL of the managers' PostgreSQL database, for a site started with replicas.
    pub fn postgres_url(&self) -> Option<&str> {
        self.postgres.as_ref().map(|p| p.url.as_str())
    }

    /// The image store the manager and the agent share: `<store>/sha256/`, `<store>/.partial/`.
    pub fn images_dir(&self) -> PathBuf {
        self.dir.path().join("images")
    }

    fn wait_for_node(&self) {
        let node = self.node.clone();
        self.wait_until(
            "the node to register its GPUs",
            Duration::from_secs(30),
            || {
                let nodes: Value = self.devctl_json(&self.admin, &["gpus"]).ok()?;
                nodes
                    .as_array()?
                    .iter()
                    .any(|n| n["name"] == node.as_str() && n["online"] == true)
                    .then_some(())
            },
        );
    }

    /// Runs devctl as `user`.
    pub fn devctl(&self, user: &User, args: &[&str]) -> Output {
        self.devctl_env(user, &[], args)
    }

    /// Runs devctl and requires success; returns stdout.
    pub fn devctl_ok(&self, user: &User, args: &[&str]) -> String {
        let out = self.devctl(user, args);
        assert!(
            out.status.success(),
            "devctl {} failed ({}):\nstdout: {}\nstderr: {}\n{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            self.logs()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs devctl with `--json` appended and parses its output.
    pub fn devctl_json<T: DeserializeOwned>(
        &self,
        user: &User,
        args: &[&str],
    ) -> anyhow::Result<T> {
        let mut args = args.to_vec();
        args.push("--json");
        let out = self.devctl(user, &args);
        if !out.status.success() {
            bail!(
                "devctl {} failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        serde_json::from_slice(&out.stdout)
            .with_context(|| format!("parsing the JSON of devctl {}", args.join(" ")))
    }

    /// Polls `check` every 250 ms until it returns `Some`, or panics with the logs.
    pub fn wait_until<T>(
        &self,
        what: &str,
        timeout: Duration,
        mut check: impl FnMut() -> Option<T>,
    ) -> T {
        let start = Instant::now();
        loop {
            if let Some(value) = check() {
                return value;
            }
            if start.elapsed() > timeout {
                panic!(
                    "timed out after {timeout:?} waiting for {what}\n{}",
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Waits until `user`'s session `name` is in `state`; returns its JSON view.
    pub fn wait_for_state(&self, user: &User, name: &str, state: &str) -> Value {
        self.wait_until(
            &format!("session {name} to be {state}"),
            Duration::from_secs(60),
            || {
                let view: Value = self.devctl_json(user, &["session", "show", name]).ok()?;
                (view["state"] == state).then_some(view)
            },
        )
    }
}

/// Appends the row `what|ours|reference|ratio` to the file `ONGRID_BENCH_SUMMARY` names, if it
/// is set: the side-by-side table `bench/run.sh` prints at its end (`-` where there is no
/// reference). The ratio has three decimals, so one close to a target (0.9, 1.5) reads on the
/// right side of it.
pub fn bench_summary(what: &str, ours: &str, reference: &str, ratio: Option<f64>) {
    use std::io::Write;
    let Some(path) = std::env::var_os("ONGRID_BENCH_SUMMARY") else {
        return;
    };
    let ratio = ratio.map_or_else(|| "-".to_owned(), |r| format!("{r:.3}"));
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("open {}: {e}", Path::new(&path).display()));
    writeln!(file, "{what}|{ours}|{reference}|{ratio}")
        .unwrap_or_else(|e| panic!("write {}: {e}", Path::new(&path).display()));
}

/// The resident memory of process `pid` in KiB (`VmRSS` of `/proc/<pid>/status`); `None` once
/// it is gone.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// The CPU time process `pid` has used, user and system, all its threads, in seconds (`utime`
/// and `stime` of `/proc/<pid>/stat`, in the 1/100 s ticks Linux shows user space whatever its
/// own tick); `None` once it is gone.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name in parentheses (which may hold spaces): state is field 3, utime
    // field 14 and stime field 15.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = |field: usize| fields.get(field - 3)?.parse::<u64>().ok();
    Some((ticks(14)? + ticks(15)?) as f64 / 100.0)
}

/// Whether the SSH server at `addr` greets a new connection with its banner (`SSH-2.0-`).
fn greets(addr: &str) -> bool {
    use std::io::Read;
    let Ok(mut stream) = std::net::TcpStream::connect(addr) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let mut banner = [0u8; 8];
    stream.read_exact(&mut banner).is_ok() && banner.starts_with(b"SSH-2.0-")
}

/// The options that make OpenSSH log in to `port` on loopback with the key `key` and nothing of
/// the machine's own configuration: no agent, no prompt, no known-hosts file.
pub fn ssh_client_options(port: &str, key: &Path) -> Vec<String> {
    [
        "-F",
        "/dev/null",
        "-p",
        port,
        "-i",
        &key.display().to_string(),
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "LogLevel=ERROR",
        "-o",
        "ConnectTimeout=20",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

/// Makes an ed25519 key pair without passphrase at `path` (and `path.pub`).
pub fn ssh_keygen(path: &Path) -> anyhow::Result<PathBuf> {
    let out = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", "e2e", "-f"])
        .arg(path)
        .output()
        .context("run ssh-keygen (install openssh-client)")?;
    if !out.status.success() {
        bail!(
            "ssh-keygen failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(path.to_path_buf())
}

/// A child process of the harness that is killed (SIGKILL) and reaped when dropped, so a
/// failing test never leaves a binary running; [`terminate`] stops it gracefully instead.
pub struct Process {
    child: Option<Child>,
    name: String,
}

impl Process {
    /// Takes charge of `child` (`name` for messages): killed and reaped when dropped.
    pub fn new(child: Child, name: &str) -> Self {
        Self {
            child: Some(child),
            name: name.to_owned(),
        }
    }
}

impl Process {
    /// Kills the process with SIGKILL, as a crash or the OOM killer would, and reaps it.
    /// Panics if it had exited before (a test that means to kill a running process must not pass
    /// when it was already gone).
    pub fn kill_hard(mut self) {
        use std::os::unix::process::ExitStatusExt;
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Ok(Some(status)) = child.try_wait() {
            panic!("{} had already exited ({status})", self.name);
        }
        child
            .kill()
            .unwrap_or_else(|e| panic!("kill {}: {e}", self.name));
        let status = child
            .wait()
            .unwrap_or_else(|e| panic!("wait for {}: {e}", self.name));
        assert_eq!(
            status.signal(),
            Some(9),
            "{} was to be killed by SIGKILL: {status}",
            self.name
        );
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Stops a process with SIGTERM and waits up to 15 s for it to exit; panics (after killing it)
/// if it does not, since a daemon that ignores SIGTERM is a bug.
fn terminate(mut process: Process) {
    let Some(mut child) = process.child.take() else {
        return;
    };
    let pid = child.id().to_string();
    let _ = Command::new("kill").args(["-TERM", &pid]).status();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(15) {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("{} did not exit within 15 s of SIGTERM", process.name);
}

impl Drop for Site {
    fn drop(&mut self) {
        // Every process first (Process kills on drop), then the containers they made.
        drop(self.gateway.take());
        drop(self.agent.take());
        drop(self.manager.take());
        drop(self.manager2.take());
        drop(self.postgres.take());
        let host = self.docker.as_ref().map(|docker| docker.host.as_str());
        remove_docker_objects(host, &self.node, &self.suffix);
        // On a daemon of the test's own, the chains live in its network namespace, which goes
        // with it.
        if host.is_none() {
            remove_firewall_chains(&self.node);
        }
        // Every binary escapes what a peer controls (a login, a forwarded host, a DN): a raw
        // control character in a log would let a client forge log lines.
        if !std::thread::panicking() {
            let forged = control_characters_in_logs(self.dir.path());
            assert!(
                forged.is_empty(),
                "raw control characters in the logs of this test's processes:\n{}",
                forged.join("\n")
            );
        }
    }
}

/// The lines of the `*.log` files in `dir` that hold a control character other than a tab, as
/// `file:line: text` with the characters shown escaped.
pub fn control_characters_in_logs(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    files.sort();
    for file in files {
        let Ok(bytes) = std::fs::read(&file) else {
            continue;
        };
        let text = String::from_utf8_lossy(&bytes);
        for (n, line) in text.split('\n').enumerate() {
            if line.chars().any(|c| c.is_control() && c != '\t') {
                found.push(format!(
                    "{}:{}: {}",
                    file.display(),
                    n + 1,
                    line.escape_debug()
                ));
            }
        }
    }
    found
}

/// Removes the iptables chains and jumps the agent of `node` made, with the agent's own code
/// (`Iptables::remove_blocking`): an agent killed, or stopped with containers left, leaves them
/// in place, so that its sessions stay isolated while it restarts, and so the test that
/// started it takes them out.
fn remove_firewall_chains(node: &str) {
    let Ok(node) = NodeName::parse(node) else {
        return;
    };
    // The chains' names and jumps depend on the node alone, not on the policy.
    let policy = NetworkPolicy::parse(NetworkPolicy::DEFAULT_SUBNET_POOL, &[], &[])
        .expect("the default subnet pool is valid");
    if let Err(e) = Iptables::new(&node, &policy).remove_blocking() {
        eprintln!("removing the firewall chains of node {node}: {e}");
    }
}

/// `docker`, or `docker -H HOST` for a daemon other than the machine's.
/// Removes, from the daemon at `host` (the machine's: `None`), the ongrid containers of `node`
/// or of users whose login contains `suffix` (sessions' and batch jobs' `ongrid-job-*`), the
/// networks the agent of `node` made, and the home volumes whose name contains `suffix`.
fn remove_docker_objects(host: Option<&str>, node: &str, suffix: &str) {
    let rows = docker_lines_on(
        host,
        &[
            "ps",
            "-a",
            "--filter",
            "label=ongrid.managed=true",
            "--format",
            "{{.ID}} {{.Label \"ongrid.node\"}} {{.Label \"ongrid.user\"}}",
        ],
    );
    for row in rows {
        let mut fields = row.split_whitespace();
        let (Some(id), rest) = (fields.next(), fields.collect::<Vec<_>>()) else {
            continue;
        };
        if rest.iter().any(|f| *f == node || f.contains(suffix)) {
            let _ = docker_on(host).args(["rm", "-f", id]).output();
        }
    }
    let node_label = format!("label=ongrid.node={node}");
    for network in docker_lines_on(host, &["network", "ls", "-q", "--filter", &node_label]) {
        let _ = docker_on(host).args(["network", "rm", &network]).output();
    }
    let volumes = docker_lines_on(
        host,
        &[
            "volume",
            "ls",
            "-q",
            "--filter",
            "label=ongrid.managed=true",
        ],
    );
    for volume in volumes.iter().filter(|v| v.contains(suffix)) {
        let _ = docker_on(host)
            .args(["volume", "rm", "-f", volume])
            .output();
    }
}

#[cfg(test)]
mod log_scan_tests {
    use super::control_characters_in_logs;

    #[test]
    fn a_forged_line_in_a_log_is_found_and_shown_escaped() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("gateway.log"),
            "INFO login=\"a\\u{1b}[2J\"\tescaped\nINFO login=bob\u{1b}[2J\rINFO key accepted\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("notes.txt"), "\u{7}").unwrap();
        let found = control_characters_in_logs(dir.path());
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].ends_with("gateway.log:2: INFO login=bob\\u{1b}[2J\\rINFO key accepted"),
            "{found:?}"
        );
        assert!(control_characters_in_logs(&dir.path().join("none")).is_empty());
    }
}
