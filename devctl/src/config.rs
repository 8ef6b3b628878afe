//! Where devctl finds the manager, the user's credential and the CAs to trust.
//!
//! The credential is a bearer token when WLCG Bearer Token Discovery finds one (`BEARER_TOKEN`,
//! `BEARER_TOKEN_FILE`, `$XDG_RUNTIME_DIR/bt_u<uid>`, `/tmp/bt_u<uid>`, the first that is set or
//! exists), unless `--cert` asks for the certificate; else the certificate or proxy, as below.
//!
//! Each setting comes from the strongest source that has it: a command-line flag, then an
//! environment variable, then the config file (`~/.config/ongrid/devctl.toml`, or the file named
//! by `ONGRID_DEVCTL_CONFIG` or `--config`), then the grid's defaults
//! (`/tmp/x509up_u<uid>`, `/etc/grid-security/certificates`). Every resolved value remembers its
//! [`Origin`], so an error can say which setting to fix.
//!
//! The environment is passed in as an [`Env`] and the grid defaults as [`Defaults`], so tests
//! never read or change the process environment.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ongrid_service::Token;
use reqwest::Url;
use serde::Deserialize;

pub use crate::origin::Origin;
use crate::token::{TokenSource, ENV_BEARER_TOKEN, ENV_BEARER_TOKEN_FILE};

/// The manager's URL.
pub const ENV_MANAGER_URL: &str = "ONGRID_MANAGER_URL";
/// The config file's path.
pub const ENV_CONFIG: &str = "ONGRID_DEVCTL_CONFIG";
/// A certificate file (PEM); its key is in `X509_USER_KEY`, or in the same file.
pub const ENV_USER_CERT: &str = "X509_USER_CERT";
/// The private key (PEM) of `X509_USER_CERT`.
pub const ENV_USER_KEY: &str = "X509_USER_KEY";
/// A grid proxy: certificate, key and chain in one PEM file.
pub const ENV_USER_PROXY: &str = "X509_USER_PROXY";
/// The directory of trusted CAs (`<hash>.0` PEM files).
pub const ENV_CERT_DIR: &str = "X509_CERT_DIR";
/// The user's runtime directory, where `bt_u<uid>` holds the bearer token.
pub const ENV_XDG_RUNTIME_DIR: &str = "XDG_RUNTIME_DIR";

/// The environment variables devctl reads. Empty values count as unset, as grid tools do.
#[derive(Debug, Clone, Default)]
pub struct Env {
    vars: BTreeMap<String, String>,
}

impl Env {
    /// The process environment (variables that are not valid UTF-8 are left out).
    pub fn from_process() -> Self {
        std::env::vars_os()
            .filter_map(|(key, value)| Some((key.into_string().ok()?, value.into_string().ok()?)))
            .collect()
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.vars
            .get(key)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    }

    fn path(&self, key: &str) -> Option<PathBuf> {
        self.get(key).map(PathBuf::from)
    }
}

impl<K: Into<String>, V: Into<String>> FromIterator<(K, V)> for Env {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        Self {
            vars: iter
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        }
    }
}

/// The grid's defaults, used when nothing else names a setting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Defaults {
    /// `/tmp/x509up_u<uid>`, where `voms-proxy-init` writes the proxy; `None` when the uid is
    /// unknown.
    pub proxy_file: Option<PathBuf>,
    /// The current user's uid, which names the token file in `$XDG_RUNTIME_DIR`.
    pub uid: Option<u32>,
    /// `/tmp/bt_u<uid>`, the bearer token file of last resort; `None` when the uid is unknown.
    pub token_file: Option<PathBuf>,
    pub ca_dir: PathBuf,
}

impl Defaults {
    /// The defaults of this machine, for the current user.
    pub fn grid() -> Self {
        let uid = current_uid();
        Self {
            proxy_file: uid.map(|uid| PathBuf::from(format!("/tmp/x509up_u{uid}"))),
            uid,
            token_file: uid.map(|uid| PathBuf::from(format!("/tmp/bt_u{uid}"))),
            ca_dir: PathBuf::from("/etc/grid-security/certificates"),
        }
    }
}

/// The current user's uid as `getuid()` (and, for a normal process, `id -u`) gives it: the
/// real uid on the `Uid:` line of `/proc/self/status`. Read from procfs to avoid `unsafe` libc.
pub fn current_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    uid_from_status(&status)
}

fn uid_from_status(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|uid| uid.parse().ok())
}

/// Values given on the command line; they beat every other source.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    pub config: Option<PathBuf>,
    pub manager_url: Option<String>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub ca_dir: Option<PathBuf>,
}

/// The config file, `~/.config/ongrid/devctl.toml`. Every key is optional.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// `https://manager.example.org:8443`, or the URLs of the manager's replicas.
    pub manager_url: Option<ManagerUrls>,
    /// PEM certificate (or a whole proxy file).
    pub cert: Option<PathBuf>,
    /// PEM private key; `cert` when absent.
    pub key: Option<PathBuf>,
    /// Directory of trusted CAs.
    pub ca_dir: Option<PathBuf>,
}

/// A resolved value and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setting<T> {
    pub value: T,
    pub origin: Origin,
}

/// What devctl authenticates with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Credential {
    /// A bearer token, sent in `Authorization`; no client certificate is presented.
    Token(TokenSource),
    /// A certificate or proxy, presented as the TLS client certificate.
    Certificate(Credentials),
}

/// The certificate and key files devctl presents to the manager.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    pub cert: PathBuf,
    /// The same file as `cert` for a proxy.
    pub key: PathBuf,
    pub origin: Origin,
}

/// `manager_url` in the config file: one URL, or a list (the manager's replicas).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum ManagerUrls {
    One(String),
    Several(Vec<String>),
}

impl ManagerUrls {
    /// As `ONGRID_MANAGER_URL` and `--manager-url` write several: separated by commas.
    fn joined(&self) -> String {
        match self {
            Self::One(url) => url.clone(),
            Self::Several(urls) => urls.join(","),
        }
    }
}

/// Everything devctl needs to talk to the manager.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Always `https`, with a path ending in `/`, so `join("v1/...")` appends. The first of
    /// the managers named.
    pub manager_url: Setting<Url>,
    /// The other managers named (`https://m1,https://m2`, or a list in the config file): the
    /// manager's replicas, asked in turn when one cannot be reached.
    pub other_managers: Vec<Url>,
    pub credential: Credential,
    pub ca_dir: Setting<PathBuf>,
}

/// Why the settings could not be resolved. Each message names the setting to fix.
///
/// Causes are part of the message (`cause`) rather than a `#[source]`: devctl prints one line
/// that ends with the fix, so the cause must come before it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {} (named by {origin}): {cause}", path.display())]
    ConfigUnreadable {
        path: PathBuf,
        origin: Origin,
        cause: String,
    },
    #[error("config file {}, line {line}: {message}", path.display())]
    ConfigInvalid {
        path: PathBuf,
        line: usize,
        message: String,
    },
    /// The config file (which names the key devctl presents) is open to others.
    #[error(transparent)]
    TooOpen(#[from] crate::permissions::TooOpen),
    #[error("no manager URL: set {ENV_MANAGER_URL} or manager_url in {config}")]
    NoManagerUrl { config: String },
    #[error("manager URL {value:?} (from {origin}) {problem}: it must look like https://manager.example.org:8443")]
    BadManagerUrl {
        value: String,
        origin: Origin,
        problem: String,
    },
    #[error("{key_origin} names a key but no certificate is set: set {cert_setting} too")]
    KeyWithoutCert {
        key_origin: Origin,
        cert_setting: String,
    },
    #[error("no grid certificate found ({looked}): run voms-proxy-init (or grid-proxy-init), or set {ENV_USER_PROXY}, or {ENV_USER_CERT} and {ENV_USER_KEY}")]
    NoCredentials { looked: String },
}

/// Resolves every setting, reading the config file if there is one.
pub fn resolve(
    overrides: &Overrides,
    env: &Env,
    defaults: &Defaults,
) -> Result<Settings, ConfigError> {
    let file = load_file(overrides, env)?;
    let config_name = file
        .as_ref()
        .map(|(path, _)| path.display().to_string())
        .unwrap_or_else(|| "~/.config/ongrid/devctl.toml".to_owned());
    let empty = FileConfig::default();
    let (file_path, file_config) = match &file {
        Some((path, config)) => (Some(path.as_path()), config),
        None => (None, &empty),
    };
    let from_file = |key: &'static str| Origin::File {
        key,
        path: file_path.map(Path::to_path_buf).unwrap_or_default(),
    };

    let manager_url = first_of([
        overrides
            .manager_url
            .clone()
            .map(|v| (v, Origin::Flag("manager-url"))),
        env.get(ENV_MANAGER_URL)
            .map(|v| (v.to_owned(), Origin::Env(ENV_MANAGER_URL))),
        file_config
            .manager_url
            .as_ref()
            .map(|v| (v.joined(), from_file("manager_url"))),
    ])
    .ok_or(ConfigError::NoManagerUrl {
        config: config_name.clone(),
    })?;
    let (value, origin) = manager_url;
    let mut urls = value
        .split(',')
        .map(str::trim)
        .filter(|url| !url.is_empty())
        .map(|url| parse_manager_url(url, origin.clone()).map(|setting| setting.value))
        .collect::<Result<Vec<_>, _>>()?;
    if urls.is_empty() {
        return Err(ConfigError::BadManagerUrl {
            value,
            origin,
            problem: "names no URL".to_owned(),
        });
    }
    let other_managers = urls.split_off(1);
    let manager_url = Setting {
        value: urls.remove(0),
        origin,
    };

    let credential = match discover_token(overrides, env, defaults) {
        Some(source) => Credential::Token(source),
        None => Credential::Certificate(resolve_credentials(
            overrides,
            env,
            file_path,
            file_config,
            defaults,
        )?),
    };

    let ca_dir = first_of([
        overrides
            .ca_dir
            .clone()
            .map(|v| (v, Origin::Flag("ca-dir"))),
        env.path(ENV_CERT_DIR)
            .map(|v| (v, Origin::Env(ENV_CERT_DIR))),
        file_config.ca_dir.clone().map(|v| (v, from_file("ca_dir"))),
    ])
    .unwrap_or_else(|| (defaults.ca_dir.clone(), Origin::Default));

    Ok(Settings {
        manager_url,
        other_managers,
        credential,
        ca_dir: Setting {
            value: ca_dir.0,
            origin: ca_dir.1,
        },
    })
}

fn first_of<T, const N: usize>(candidates: [Option<(T, Origin)>; N]) -> Option<(T, Origin)> {
    candidates.into_iter().flatten().next()
}

/// Reads the config file: `--config`, else `ONGRID_DEVCTL_CONFIG`, else
/// `$HOME/.config/ongrid/devctl.toml`. A file named explicitly must exist; the default one may
/// be absent. Relative paths inside it are relative to its directory, and `~/` is `$HOME/`.
fn load_file(
    overrides: &Overrides,
    env: &Env,
) -> Result<Option<(PathBuf, FileConfig)>, ConfigError> {
    let named = overrides
        .config
        .clone()
        .map(|p| (p, Origin::Flag("config")))
        .or_else(|| env.path(ENV_CONFIG).map(|p| (p, Origin::Env(ENV_CONFIG))));
    let (path, origin) = match named {
        Some(named) => named,
        None => match env.get("HOME") {
            Some(home) => (
                Path::new(home).join(".config/ongrid/devctl.toml"),
                Origin::Default,
            ),
            None => return Ok(None),
        },
    };
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(err) if origin == Origin::Default && err.kind() == std::io::ErrorKind::NotFound => {
            return Ok(None)
        }
        Err(err) => {
            return Err(ConfigError::ConfigUnreadable {
                path,
                origin,
                cause: err.to_string(),
            })
        }
    };
    crate::permissions::check(&path, "config file")?;
    let mut config = parse_file(&path, &text)?;
    let base = path.parent().unwrap_or(Path::new("")).to_path_buf();
    let home = env.path("HOME");
    for field in [&mut config.cert, &mut config.key, &mut config.ca_dir] {
        if let Some(value) = field.take() {
            *field = Some(anchor_path(value, &base, home.as_deref()));
        }
    }
    Ok(Some((path, config)))
}

/// Parses the file's text, turning TOML's multi-line report into one line.
pub fn parse_file(path: &Path, text: &str) -> Result<FileConfig, ConfigError> {
    toml::from_str(text).map_err(|err: toml::de::Error| {
        let line = err
            .span()
            .map(|span| text[..span.start.min(text.len())].matches('\n').count() + 1)
            .unwrap_or(1);
        ConfigError::ConfigInvalid {
            path: path.to_path_buf(),
            line,
            message: err.message().trim().replace('\n', " "),
        }
    })
}

fn anchor_path(value: PathBuf, base: &Path, home: Option<&Path>) -> PathBuf {
    if let (Ok(rest), Some(home)) = (value.strip_prefix("~"), home) {
        return home.join(rest);
    }
    if value.is_relative() {
        return base.join(value);
    }
    value
}

fn parse_manager_url(value: &str, origin: Origin) -> Result<Setting<Url>, ConfigError> {
    let bad = |problem: &str| ConfigError::BadManagerUrl {
        value: value.to_owned(),
        origin: origin.clone(),
        problem: problem.to_owned(),
    };
    let mut url = Url::parse(value).map_err(|err| bad(&format!("is not a URL ({err})")))?;
    if url.scheme() != "https" {
        return Err(bad("does not start with https://"));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(bad("has no host"));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(bad("has a query or fragment"));
    }
    if !url.path().ends_with('/') {
        let path = format!("{}/", url.path());
        url.set_path(&path);
    }
    Ok(Setting { value: url, origin })
}

/// WLCG Bearer Token Discovery: `BEARER_TOKEN` (the token), `BEARER_TOKEN_FILE` (a file, which
/// must then exist: its read says why not), `$XDG_RUNTIME_DIR/bt_u<uid>`, `/tmp/bt_u<uid>`; the
/// first that is set or exists. `None` (use the certificate) when there is none, or when
/// `--cert` asks for the certificate.
fn discover_token(overrides: &Overrides, env: &Env, defaults: &Defaults) -> Option<TokenSource> {
    if overrides.cert.is_some() {
        return None;
    }
    if let Some(token) = env.get(ENV_BEARER_TOKEN) {
        return Some(TokenSource::Variable(Token::new(token)));
    }
    let file = |path: PathBuf, origin: Origin| TokenSource::File { path, origin };
    if let Some(path) = env.path(ENV_BEARER_TOKEN_FILE) {
        return Some(file(path, Origin::Env(ENV_BEARER_TOKEN_FILE)));
    }
    let runtime = env
        .path(ENV_XDG_RUNTIME_DIR)
        .zip(defaults.uid)
        .map(|(dir, uid)| {
            (
                dir.join(format!("bt_u{uid}")),
                Origin::Env(ENV_XDG_RUNTIME_DIR),
            )
        });
    let last = defaults
        .token_file
        .clone()
        .map(|path| (path, Origin::Default));
    [runtime, last]
        .into_iter()
        .flatten()
        .find(|(path, _)| path.is_file())
        .map(|(path, origin)| file(path, origin))
}

fn resolve_credentials(
    overrides: &Overrides,
    env: &Env,
    file_path: Option<&Path>,
    file: &FileConfig,
    defaults: &Defaults,
) -> Result<Credentials, ConfigError> {
    let pair = |cert: PathBuf, key: Option<PathBuf>, origin: Origin| Credentials {
        key: key.unwrap_or_else(|| cert.clone()),
        cert,
        origin,
    };
    if let Some(cert) = &overrides.cert {
        return Ok(pair(
            cert.clone(),
            overrides.key.clone(),
            Origin::Flag("cert"),
        ));
    }
    if let Some(key) = &overrides.key {
        return Err(ConfigError::KeyWithoutCert {
            key_origin: Origin::Flag("key"),
            cert_setting: format!("--cert {}", key.display()),
        });
    }
    match (env.path(ENV_USER_CERT), env.path(ENV_USER_KEY)) {
        (Some(cert), key) => return Ok(pair(cert, key, Origin::Env(ENV_USER_CERT))),
        (None, Some(_)) => {
            return Err(ConfigError::KeyWithoutCert {
                key_origin: Origin::Env(ENV_USER_KEY),
                cert_setting: ENV_USER_CERT.to_owned(),
            })
        }
        (None, None) => {}
    }
    if let Some(proxy) = env.path(ENV_USER_PROXY) {
        return Ok(pair(proxy, None, Origin::Env(ENV_USER_PROXY)));
    }
    let file_origin = |key| Origin::File {
        key,
        path: file_path.map(Path::to_path_buf).unwrap_or_default(),
    };
    match (&file.cert, &file.key) {
        (Some(cert), key) => return Ok(pair(cert.clone(), key.clone(), file_origin("cert"))),
        (None, Some(_)) => {
            return Err(ConfigError::KeyWithoutCert {
                key_origin: file_origin("key"),
                cert_setting: "cert in the same file".to_owned(),
            })
        }
        (None, None) => {}
    }
    match &defaults.proxy_file {
        Some(proxy) if proxy.is_file() => Ok(pair(proxy.clone(), None, Origin::Default)),
        proxy => {
            let config = file_path
                .map(|p| format!("no cert in {}", p.display()))
                .unwrap_or_else(|| "no config file".to_owned());
            let proxy = proxy
                .as_ref()
                .map(|p| format!("{} does not exist", p.display()))
                .unwrap_or_else(|| "the uid for /tmp/x509up_u<uid> is unknown".to_owned());
            Err(ConfigError::NoCredentials {
                looked: format!(
                    "{ENV_USER_CERT} and {ENV_USER_PROXY} are not set, {config}, {proxy}"
                ),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixture {
        dir: tempfile::TempDir,
    }

    impl Fixture {
        fn new() -> Self {
            Self {
                dir: tempfile::tempdir().unwrap(),
            }
        }

        fn home(&self) -> String {
            self.dir.path().display().to_string()
        }

        fn write_config(&self, text: &str) -> PathBuf {
            let dir = self.dir.path().join(".config/ongrid");
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("devctl.toml");
            std::fs::write(&path, text).unwrap();
            private(&path);
            path
        }

        fn defaults(&self) -> Defaults {
            Defaults {
                proxy_file: Some(self.dir.path().join("x509up_u1000")),
                uid: Some(1000),
                token_file: Some(self.dir.path().join("bt_u1000")),
                ca_dir: PathBuf::from("/etc/grid-security/certificates"),
            }
        }

        fn create_default_proxy(&self) {
            std::fs::write(self.dir.path().join("x509up_u1000"), "proxy").unwrap();
        }

        fn env(&self, vars: &[(&str, &str)]) -> Env {
            let mut all = vec![("HOME".to_owned(), self.home())];
            all.extend(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())));
            all.into_iter().collect()
        }
    }

    /// The certificate the settings name; panics on a token.
    fn certificate(s: &Settings) -> &Credentials {
        match &s.credential {
            Credential::Certificate(credentials) => credentials,
            Credential::Token(source) => panic!("a token from {source}, not a certificate"),
        }
    }

    /// Where the token the settings name comes from; panics on a certificate.
    fn token(s: &Settings) -> &TokenSource {
        match &s.credential {
            Credential::Token(source) => source,
            Credential::Certificate(c) => panic!("a certificate from {}, not a token", c.origin),
        }
    }

    /// Mode 0600, as devctl wants a config file.
    fn private(path: &Path) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
    }

    const URL_VAR: (&str, &str) = (ENV_MANAGER_URL, "https://env.example.org:8443");

    #[test]
    fn uid_is_read_from_the_status_file() {
        let status = "Name:\tdevctl\nUmask:\t0022\nUid:\t1000\t1001\t1000\t1000\nGid:\t100\n";
        assert_eq!(uid_from_status(status), Some(1000));
        assert_eq!(uid_from_status("Name:\tx\n"), None);
        assert!(
            current_uid().is_some(),
            "this test runs on Linux with /proc"
        );
    }

    #[test]
    fn grid_defaults_without_config_file() {
        let f = Fixture::new();
        f.create_default_proxy();
        let s = resolve(&Overrides::default(), &f.env(&[URL_VAR]), &f.defaults()).unwrap();
        assert_eq!(
            s.manager_url.value.as_str(),
            "https://env.example.org:8443/"
        );
        assert_eq!(s.manager_url.origin, Origin::Env(ENV_MANAGER_URL));
        assert_eq!(certificate(&s).cert, f.dir.path().join("x509up_u1000"));
        assert_eq!(certificate(&s).key, certificate(&s).cert);
        assert_eq!(certificate(&s).origin, Origin::Default);
        assert_eq!(
            s.ca_dir.value,
            PathBuf::from("/etc/grid-security/certificates")
        );
        assert_eq!(s.ca_dir.origin, Origin::Default);
    }

    /// Several managers (replicas): a list in the config file, or comma-separated in
    /// `ONGRID_MANAGER_URL` and `--manager-url`; each checked like one.
    #[test]
    fn several_managers_are_a_list_or_comma_separated() {
        let f = Fixture::new();
        f.create_default_proxy();
        f.write_config(r#"manager_url = ["https://127.0.0.1:8443", "https://127.0.0.2:8443"]"#);
        let s = resolve(&Overrides::default(), &f.env(&[]), &f.defaults()).unwrap();
        assert_eq!(s.manager_url.value.as_str(), "https://127.0.0.1:8443/");
        assert_eq!(
            s.other_managers.iter().map(Url::as_str).collect::<Vec<_>>(),
            ["https://127.0.0.2:8443/"]
        );
        let overrides = Overrides {
            manager_url: Some("https://127.0.0.3, https://127.0.0.4/x".into()),
            ..Overrides::default()
        };
        let s = resolve(&overrides, &f.env(&[]), &f.defaults()).unwrap();
        assert_eq!(s.manager_url.value.as_str(), "https://127.0.0.3/");
        assert_eq!(s.other_managers[0].as_str(), "https://127.0.0.4/x/");
        let overrides = Overrides {
            manager_url: Some("https://127.0.0.3,http://127.0.0.4".into()),
            ..Overrides::default()
        };
        let err = resolve(&overrides, &f.env(&[]), &f.defaults()).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("manager URL \"http://127.0.0.4\" (from --manager-url) does not start with https://"),
            "{err}"
        );
    }

    #[test]
    fn file_beats_defaults_and_anchors_relative_paths() {
        let f = Fixture::new();
        f.create_default_proxy();
        let path = f.write_config(
            r#"
            manager_url = "https://file.example.org"
            cert = "usercert.pem"
            key = "~/keys/userkey.pem"
            ca_dir = "/opt/cas"
            "#,
        );
        let s = resolve(&Overrides::default(), &f.env(&[]), &f.defaults()).unwrap();
        assert_eq!(s.manager_url.value.as_str(), "https://file.example.org/");
        assert_eq!(
            s.manager_url.origin,
            Origin::File {
                key: "manager_url",
                path: path.clone()
            }
        );
        assert_eq!(
            certificate(&s).cert,
            f.dir.path().join(".config/ongrid/usercert.pem")
        );
        assert_eq!(certificate(&s).key, f.dir.path().join("keys/userkey.pem"));
        assert_eq!(s.ca_dir.value, PathBuf::from("/opt/cas"));
        assert_eq!(
            certificate(&s).origin.to_string(),
            format!("cert in {}", path.display())
        );
    }

    #[test]
    fn env_beats_file() {
        let f = Fixture::new();
        f.write_config(
            r#"
            manager_url = "https://file.example.org"
            cert = "/file/cert.pem"
            ca_dir = "/file/cas"
            "#,
        );
        let env = f.env(&[
            URL_VAR,
            (ENV_USER_PROXY, "/env/proxy"),
            (ENV_CERT_DIR, "/env/cas"),
        ]);
        let s = resolve(&Overrides::default(), &env, &f.defaults()).unwrap();
        assert_eq!(s.manager_url.origin, Origin::Env(ENV_MANAGER_URL));
        assert_eq!(certificate(&s).cert, PathBuf::from("/env/proxy"));
        assert_eq!(certificate(&s).key, PathBuf::from("/env/proxy"));
        assert_eq!(certificate(&s).origin, Origin::Env(ENV_USER_PROXY));
        assert_eq!(s.ca_dir.value, PathBuf::from("/env/cas"));
        assert_eq!(s.ca_dir.origin, Origin::Env(ENV_CERT_DIR));
    }

    #[test]
    fn user_cert_beats_proxy() {
        let f = Fixture::new();
        let env = f.env(&[
            URL_VAR,
            (ENV_USER_CERT, "/c.pem"),
            (ENV_USER_KEY, "/k.pem"),
            (ENV_USER_PROXY, "/proxy"),
        ]);
        let s = resolve(&Overrides::default(), &env, &f.defaults()).unwrap();
        assert_eq!(certificate(&s).cert, PathBuf::from("/c.pem"));
        assert_eq!(certificate(&s).key, PathBuf::from("/k.pem"));
        assert_eq!(certificate(&s).origin, Origin::Env(ENV_USER_CERT));
    }

    #[test]
    fn flags_beat_env() {
        let f = Fixture::new();
        let env = f.env(&[
            URL_VAR,
            (ENV_USER_PROXY, "/proxy"),
            (ENV_CERT_DIR, "/env/cas"),
        ]);
        let overrides = Overrides {
            config: None,
            manager_url: Some("https://flag.example.org:9443/ongrid".to_owned()),
            cert: Some(PathBuf::from("/flag/cert.pem")),
            key: Some(PathBuf::from("/flag/key.pem")),
            ca_dir: Some(PathBuf::from("/flag/cas")),
        };
        let s = resolve(&overrides, &env, &f.defaults()).unwrap();
        assert_eq!(
            s.manager_url.value.as_str(),
            "https://flag.example.org:9443/ongrid/"
        );
        assert_eq!(s.manager_url.origin, Origin::Flag("manager-url"));
        assert_eq!(certificate(&s).cert, PathBuf::from("/flag/cert.pem"));
        assert_eq!(certificate(&s).key, PathBuf::from("/flag/key.pem"));
        assert_eq!(s.ca_dir.value, PathBuf::from("/flag/cas"));
        assert_eq!(s.ca_dir.origin.to_string(), "--ca-dir");
    }

    #[test]
    fn empty_env_values_count_as_unset() {
        let f = Fixture::new();
        f.create_default_proxy();
        let env = f.env(&[URL_VAR, (ENV_USER_PROXY, ""), (ENV_CERT_DIR, "")]);
        let s = resolve(&Overrides::default(), &env, &f.defaults()).unwrap();
        assert_eq!(certificate(&s).origin, Origin::Default);
        assert_eq!(s.ca_dir.origin, Origin::Default);
    }

    #[test]
    fn a_config_file_others_may_read_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let f = Fixture::new();
        let path = f.write_config("manager_url = \"https://manager.invalid\"\n");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let env = f.env(&[(ENV_USER_PROXY, "/p")]);
        let err = resolve(&Overrides::default(), &env, &f.defaults()).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "config file {p} has mode 0644, open to its group or others, which devctl \
                 refuses as ssh does: run `chmod 600 {p}`",
                p = path.display()
            )
        );
    }

    #[test]
    fn config_path_from_env_and_flag_must_exist() {
        let f = Fixture::new();
        let other = f.dir.path().join("other.toml");
        std::fs::write(&other, "manager_url = \"https://other.example.org\"\n").unwrap();
        private(&other);
        let env = f.env(&[
            (ENV_CONFIG, other.to_str().unwrap()),
            (ENV_USER_PROXY, "/p"),
        ]);
        let s = resolve(&Overrides::default(), &env, &f.defaults()).unwrap();
        assert_eq!(s.manager_url.value.as_str(), "https://other.example.org/");

        let missing = Overrides {
            config: Some(f.dir.path().join("missing.toml")),
            ..Overrides::default()
        };
        let err = resolve(&missing, &env, &f.defaults()).unwrap_err();
        assert!(matches!(err, ConfigError::ConfigUnreadable { .. }));
        let msg = err.to_string();
        assert!(msg.contains("missing.toml (named by --config)"), "{msg}");
    }

    #[test]
    fn unknown_keys_are_refused_with_the_line() {
        let f = Fixture::new();
        let path =
            f.write_config("manager_url = \"https://x.example.org\"\n\ncertificate = \"/c\"\n");
        let err = resolve(&Overrides::default(), &f.env(&[]), &f.defaults()).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.starts_with(&format!("config file {}, line 3: ", path.display())),
            "{msg}"
        );
        assert!(msg.contains("unknown field `certificate`"), "{msg}");
        assert!(!msg.contains('\n'), "{msg}");
    }

    #[test]
    fn manager_url_must_be_https() {
        let f = Fixture::new();
        let env = f.env(&[
            (ENV_MANAGER_URL, "http://x.example.org"),
            (ENV_USER_PROXY, "/p"),
        ]);
        let msg = resolve(&Overrides::default(), &env, &f.defaults())
            .unwrap_err()
            .to_string();
        assert_eq!(
            msg,
            "manager URL \"http://x.example.org\" (from ONGRID_MANAGER_URL) does not start with \
             https://: it must look like https://manager.example.org:8443"
        );
        let env = f.env(&[(ENV_MANAGER_URL, "manager:8443"), (ENV_USER_PROXY, "/p")]);
        assert!(matches!(
            resolve(&Overrides::default(), &env, &f.defaults()),
            Err(ConfigError::BadManagerUrl { .. })
        ));
    }

    #[test]
    fn missing_manager_url_names_both_places() {
        let f = Fixture::new();
        let msg = resolve(&Overrides::default(), &f.env(&[]), &f.defaults())
            .unwrap_err()
            .to_string();
        assert_eq!(
            msg,
            "no manager URL: set ONGRID_MANAGER_URL or manager_url in ~/.config/ongrid/devctl.toml"
        );
    }

    #[test]
    fn missing_credentials_say_where_devctl_looked() {
        let f = Fixture::new();
        let err = resolve(&Overrides::default(), &f.env(&[URL_VAR]), &f.defaults()).unwrap_err();
        let msg = err.to_string();
        let proxy = f.dir.path().join("x509up_u1000");
        assert_eq!(
            msg,
            format!(
                "no grid certificate found (X509_USER_CERT and X509_USER_PROXY are not set, no \
                 config file, {} does not exist): run voms-proxy-init (or grid-proxy-init), or \
                 set X509_USER_PROXY, or X509_USER_CERT and X509_USER_KEY",
                proxy.display()
            )
        );
    }

    /// WLCG Bearer Token Discovery, in its order, before the certificate: `BEARER_TOKEN`, then
    /// `BEARER_TOKEN_FILE`, then `$XDG_RUNTIME_DIR/bt_u<uid>`, then `/tmp/bt_u<uid>`.
    #[test]
    fn a_token_is_found_in_the_wlcg_order_before_the_certificate() {
        let f = Fixture::new();
        f.create_default_proxy();
        let runtime = f.dir.path().join("run");
        std::fs::create_dir(&runtime).unwrap();
        let runtime_file = runtime.join("bt_u1000");
        let tmp_file = f.dir.path().join("bt_u1000");
        let named = f.dir.path().join("named-token");
        let runtime_text = runtime.to_str().unwrap();
        let named_text = named.to_str().unwrap();
        let all = [
            URL_VAR,
            (ENV_USER_PROXY, "/env/proxy"),
            (ENV_BEARER_TOKEN, "a.b.c"),
            (ENV_BEARER_TOKEN_FILE, named_text),
            (ENV_XDG_RUNTIME_DIR, runtime_text),
        ];
        std::fs::write(&runtime_file, "t").unwrap();
        std::fs::write(&tmp_file, "t").unwrap();
        let resolve_with = |vars: &[(&str, &str)]| {
            resolve(&Overrides::default(), &f.env(vars), &f.defaults()).unwrap()
        };

        let s = resolve_with(&all);
        assert_eq!(
            token(&s),
            &TokenSource::Variable(Token::new("a.b.c")),
            "BEARER_TOKEN first"
        );
        // A file named by BEARER_TOKEN_FILE is used even before it exists: reading it says
        // what is wrong, rather than devctl silently taking another credential.
        assert!(!named.exists());
        let s = resolve_with(&[all[0], all[1], all[3], all[4]]);
        assert_eq!(
            token(&s),
            &TokenSource::File {
                path: named.clone(),
                origin: Origin::Env(ENV_BEARER_TOKEN_FILE)
            }
        );
        assert_eq!(
            token(&s).to_string(),
            format!("BEARER_TOKEN_FILE {named_text}")
        );
        let s = resolve_with(&[all[0], all[1], all[4]]);
        assert_eq!(
            token(&s),
            &TokenSource::File {
                path: runtime_file.clone(),
                origin: Origin::Env(ENV_XDG_RUNTIME_DIR)
            }
        );
        // $XDG_RUNTIME_DIR/bt_u<uid> absent, or XDG_RUNTIME_DIR unset: /tmp/bt_u<uid>.
        std::fs::remove_file(&runtime_file).unwrap();
        for vars in [&[all[0], all[1], all[4]][..], &[all[0], all[1]][..]] {
            let s = resolve_with(vars);
            assert_eq!(
                token(&s),
                &TokenSource::File {
                    path: tmp_file.clone(),
                    origin: Origin::Default
                }
            );
        }
        // No token anywhere (empty variables count as unset): the certificate, as before.
        std::fs::remove_file(&tmp_file).unwrap();
        let s = resolve_with(&[
            all[0],
            all[1],
            all[4],
            (ENV_BEARER_TOKEN, ""),
            (ENV_BEARER_TOKEN_FILE, ""),
        ]);
        assert_eq!(certificate(&s).cert, PathBuf::from("/env/proxy"));
        assert_eq!(certificate(&s).origin, Origin::Env(ENV_USER_PROXY));
        // An unknown uid has no token file.
        std::fs::write(&runtime_file, "t").unwrap();
        let defaults = Defaults {
            uid: None,
            token_file: None,
            ..f.defaults()
        };
        let s = resolve(&Overrides::default(), &f.env(&[all[0], all[4]]), &defaults).unwrap();
        assert_eq!(certificate(&s).origin, Origin::Default);
    }

    /// `--cert` asks for the certificate even when a token is there.
    #[test]
    fn the_cert_flag_beats_a_token() {
        let f = Fixture::new();
        std::fs::write(f.dir.path().join("bt_u1000"), "t").unwrap();
        let env = f.env(&[URL_VAR, (ENV_BEARER_TOKEN, "a.b.c")]);
        let overrides = Overrides {
            cert: Some(PathBuf::from("/flag/proxy")),
            ..Overrides::default()
        };
        let s = resolve(&overrides, &env, &f.defaults()).unwrap();
        assert_eq!(certificate(&s).cert, PathBuf::from("/flag/proxy"));
        assert_eq!(certificate(&s).origin, Origin::Flag("cert"));
        let s = resolve(&Overrides::default(), &env, &f.defaults()).unwrap();
        assert!(matches!(s.credential, Credential::Token(_)));
    }

    #[test]
    fn a_key_without_a_certificate_is_refused() {
        let f = Fixture::new();
        let env = f.env(&[URL_VAR, (ENV_USER_KEY, "/k.pem"), (ENV_USER_PROXY, "/p")]);
        let msg = resolve(&Overrides::default(), &env, &f.defaults())
            .unwrap_err()
            .to_string();
        assert_eq!(
            msg,
            "X509_USER_KEY names a key but no certificate is set: set X509_USER_CERT too"
        );
    }
}
