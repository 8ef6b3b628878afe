//! TLS for the API: the server certificate, and client certificates — plain grid certificates
//! and RFC 3820 proxies, with their VOMS attributes — turned into an [`Identity`].
//!
//! Client authentication sits behind one trait, [`ClientAuthenticator`]: it checks a presented
//! chain and says whose it is. [`GridAuthenticator`] is the implementation: `ongrid_x509` checks
//! the chain against the IGTF-style `ca_dir` (CAs, CRLs; every proxy rule of RFC 3820) and reads
//! the VOMS attributes trusted by `vomsdir`. It notices when fetch-crl or a package update
//! changes either directory and reloads them.
//!
//! [`AuthenticatorVerifier`] plugs an authenticator into rustls. webpki refuses proxies (their
//! critical ProxyCertInfo extension), so the handshake signatures are checked here with the
//! leaf's public key directly. A client certificate is optional (agents authenticate with bearer
//! tokens instead), but one that is presented must verify: if not, the handshake fails with a TLS
//! alert (`unknown_ca`, `certificate_expired`, `certificate_revoked`, ...), which devctl turns
//! into one line naming the fix.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::fmt;
use std::fs;
use std::hash::{Hash, Hasher};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use ongrid_core::api::CredentialKind;
use ongrid_core::Dn;
use ongrid_service::pem::{self, PemError};
use ongrid_x509::voms::{Fqan, VomsDir};
use ongrid_x509::{CaDir, ChainError, CrlPolicy, ProxyKind, VerifiedChain, VerifyOptions};
use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, SubjectPublicKeyInfoDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{
    CertificateError, DigitallySignedStruct, DistinguishedName, OtherError, PeerMisbehaved,
    ServerConfig, SignatureScheme,
};
use x509_parser::prelude::{FromDer, X509Certificate};

/// Who is on the other end of a connection that presented a valid client certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The subject DN of the end-entity certificate (of an independent proxy: the proxy's own),
    /// in slash form.
    pub dn: Dn,
    /// A plain certificate, or which kind of proxy.
    pub kind: CredentialKind,
    /// The VOs of the verified VOMS attribute certificates, in the order presented.
    pub vos: Vec<String>,
    /// The verified FQANs, primary first.
    pub fqans: Vec<Fqan>,
    /// Until when the credential is valid: the earliest notAfter of the chain. SSH keys
    /// registered with it expire then.
    pub not_after: DateTime<Utc>,
    /// A bearer token's issuer, subject and scopes, when the credential is one (`kind` is
    /// `Token`; `fqans` are its groups).
    pub token: Option<crate::tokens::VerifiedToken>,
}

/// The other end of the connection a request came on.
#[derive(Debug, Clone)]
pub struct Peer {
    pub addr: SocketAddr,
    /// Present when the client authenticated with a certificate.
    pub identity: Option<Identity>,
}

/// Why a client certificate chain was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("no client certificate was presented")]
    NoCertificate,
    #[error("client certificate refused: {0}")]
    Refused(#[from] ChainError),
}

impl AuthError {
    /// The rustls error that makes the handshake fail with the matching alert, which is all the
    /// client learns: `unknown_ca`, `certificate_expired`, `certificate_revoked`, or
    /// `certificate_unknown` for everything else.
    fn into_rustls(self) -> rustls::Error {
        let Self::Refused(error) = self else {
            return rustls::Error::InvalidCertificate(CertificateError::BadEncoding);
        };
        let certificate_error = match &error {
            ChainError::UnknownCa { .. } => CertificateError::UnknownIssuer,
            ChainError::ProxyExpired { .. } | ChainError::CertificateExpired { .. } => {
                CertificateError::Expired
            }
            ChainError::NotYetValid { .. } => CertificateError::NotValidYet,
            ChainError::Revoked { .. } => CertificateError::Revoked,
            _ => CertificateError::Other(OtherError(Arc::new(error))),
        };
        rustls::Error::InvalidCertificate(certificate_error)
    }
}

/// Checks a client's certificate chain and says whose it is. One implementation per kind of
/// credential the site accepts; the rest of the manager only ever sees the [`Identity`].
pub trait ClientAuthenticator: Send + Sync + fmt::Debug {
    /// `chain[0]` is the client's own certificate, the rest the intermediates it sent, in order.
    fn authenticate(
        &self,
        chain: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<Identity, AuthError>;

    /// Only whether the chain is acceptable, as the handshake needs it; the default does the
    /// whole [`Self::authenticate`].
    fn verify(&self, chain: &[CertificateDer<'_>], now: UnixTime) -> Result<(), AuthError> {
        self.authenticate(chain, now).map(|_| ())
    }

    /// Subjects of the trusted CAs, sent to clients as a hint of which certificate to present.
    fn root_hint_subjects(&self) -> &[DistinguishedName];
}

/// Why the TLS material (server identity, CA directory, vomsdir) could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsMaterialError {
    #[error(transparent)]
    File(#[from] PemError),
    #[error("ca_dir must hold the CAs of the users' certificates")]
    CaDir(#[source] ongrid_x509::CaDirError),
    #[error("vomsdir {}: {message}", path.display())]
    VomsDir { path: PathBuf, message: String },
    #[error("tls_cert and tls_key do not make a usable server identity")]
    ServerIdentity(#[source] rustls::Error),
}

/// The one crypto provider the manager uses (ring), passed explicitly so that which provider
/// other crates enable in the same process does not matter.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// What [`GridAuthenticator`] trusts and how strictly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrustConfig {
    /// IGTF layout: `<hash>.0` CA certificates, `<hash>.r0` CRLs.
    pub ca_dir: PathBuf,
    /// `<vo>/<host>.lsc` files; `None`: VOMS attributes are not read.
    pub vomsdir: Option<PathBuf>,
    /// What a CRL past its nextUpdate does.
    pub crl_policy: CrlPolicy,
}

/// How long the trust directories are believed unchanged before they are looked at again.
pub const RELOAD_CHECK: Duration = Duration::from_secs(60);
/// How long an identical warning is kept quiet after it was logged.
const WARNING_QUIET: Duration = Duration::from_secs(3600);
/// Tolerated difference between the client's and the manager's clock (as Globus and canl do).
pub const CLOCK_SKEW: Duration = Duration::from_secs(300);
/// The smallest RSA key accepted anywhere in a chain.
pub const MIN_RSA_BITS: u32 = 2048;

/// Accepts grid certificates and RFC 3820 proxies whose chain ends at a CA of `ca_dir`.
pub struct GridAuthenticator {
    config: TrustConfig,
    hints: Vec<DistinguishedName>,
    trust: RwLock<Trust>,
    reload_check: Duration,
    warned: Mutex<HashMap<String, Instant>>,
}

/// The loaded directories and what they looked like when loaded.
struct Trust {
    cas: Arc<CaDir>,
    vomsdir: Option<Arc<VomsDir>>,
    listing_digest: u64,
    checked: Instant,
}

impl fmt::Debug for GridAuthenticator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GridAuthenticator")
            .field("config", &self.config)
            .field("ca_count", &self.hints.len())
            .finish_non_exhaustive()
    }
}

impl GridAuthenticator {
    /// Loads the CA directory (and vomsdir). A directory without any CA is an error; single bad
    /// files are skipped with a warning by `ongrid_x509`.
    pub fn load(config: TrustConfig) -> Result<Self, TlsMaterialError> {
        let (cas, vomsdir) = load_trust(&config)?;
        let hints: Vec<DistinguishedName> = cas
            .subjects()
            .into_iter()
            .map(DistinguishedName::from)
            .collect();
        tracing::info!(
            ca_dir = %config.ca_dir.display(),
            ca_count = hints.len(),
            vomsdir = ?config.vomsdir,
            crl_policy = ?config.crl_policy,
            "Loaded client CAs."
        );
        let trust = Trust {
            cas,
            vomsdir,
            listing_digest: trust_dirs_listing_digest(&config),
            checked: Instant::now(),
        };
        Ok(Self {
            config,
            hints,
            trust: RwLock::new(trust),
            reload_check: RELOAD_CHECK,
            warned: Mutex::new(HashMap::new()),
        })
    }

    /// Looks at the directories for changes this often instead of [`RELOAD_CHECK`] (tests).
    pub fn with_reload_check(mut self, every: Duration) -> Self {
        self.reload_check = every;
        self
    }

    /// How many CA certificates were loaded at start.
    pub fn ca_count(&self) -> usize {
        self.hints.len()
    }

    /// The current CAs and VOMS trust, reloaded first when the directories changed since the
    /// last look (at most every `reload_check`). A reload that fails keeps the old trust.
    fn current(&self) -> (Arc<CaDir>, Option<Arc<VomsDir>>) {
        {
            let trust = self.trust.read().unwrap_or_else(|e| e.into_inner());
            if trust.checked.elapsed() < self.reload_check {
                return (trust.cas.clone(), trust.vomsdir.clone());
            }
        }
        let mut trust = self.trust.write().unwrap_or_else(|e| e.into_inner());
        if trust.checked.elapsed() >= self.reload_check {
            trust.checked = Instant::now();
            let now = trust_dirs_listing_digest(&self.config);
            if now != trust.listing_digest {
                match load_trust(&self.config) {
                    Ok((cas, vomsdir)) => {
                        tracing::info!(ca_dir = %self.config.ca_dir.display(), "Reloaded client CAs and CRLs: the directory changed.");
                        trust.cas = cas;
                        trust.vomsdir = vomsdir;
                        trust.listing_digest = now;
                    }
                    Err(error) => {
                        tracing::error!(%error, "Reloading the client CAs failed; keeping the ones loaded before.");
                    }
                }
            }
        }
        (trust.cas.clone(), trust.vomsdir.clone())
    }

    fn options(&self, now: UnixTime) -> VerifyOptions {
        let seconds = i64::try_from(now.as_secs()).unwrap_or(i64::MAX);
        let now = DateTime::from_timestamp(seconds, 0).unwrap_or(DateTime::<Utc>::MAX_UTC);
        VerifyOptions {
            clock_skew: CLOCK_SKEW,
            crl_policy: self.config.crl_policy,
            min_rsa_bits: MIN_RSA_BITS,
            allow_independent: true,
            ..VerifyOptions::at(now)
        }
    }

    fn verify_chain(
        &self,
        chain: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<Checked, AuthError> {
        if chain.is_empty() {
            return Err(AuthError::NoCertificate);
        }
        let der: Vec<Vec<u8>> = chain.iter().map(|c| c.as_ref().to_vec()).collect();
        let (cas, vomsdir) = self.current();
        let options = self.options(now);
        let verified = ongrid_x509::verify_chain(&der, &cas, &options)?;
        Ok(Checked {
            verified,
            cas,
            vomsdir,
            now: options.now,
        })
    }

    /// Logs `warning` about `dn` unless the same one was logged within the last hour.
    fn warn_once(&self, dn: &Dn, warning: &str) {
        let key = format!("{dn}\n{warning}");
        let mut warned = self.warned.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if warned
            .get(&key)
            .is_some_and(|at| now.duration_since(*at) < WARNING_QUIET)
        {
            return;
        }
        if warned.len() > 10_000 {
            warned.retain(|_, at| now.duration_since(*at) < WARNING_QUIET);
        }
        warned.insert(key, now);
        tracing::warn!(%dn, warning, "Client credential accepted with a warning.");
    }
}

/// A verified chain and the trust it was verified with (VOMS attributes are checked with it).
struct Checked {
    verified: VerifiedChain,
    cas: Arc<CaDir>,
    vomsdir: Option<Arc<VomsDir>>,
    now: DateTime<Utc>,
}

fn load_trust(
    config: &TrustConfig,
) -> Result<(Arc<CaDir>, Option<Arc<VomsDir>>), TlsMaterialError> {
    let cas = CaDir::load(&config.ca_dir).map_err(TlsMaterialError::CaDir)?;
    let vomsdir = match &config.vomsdir {
        Some(path) => Some(Arc::new(VomsDir::load(path).map_err(|e| {
            TlsMaterialError::VomsDir {
                path: path.clone(),
                message: e.to_string(),
            }
        })?)),
        None => None,
    };
    Ok((Arc::new(cas), vomsdir))
}

/// A digest of the names, sizes and modification times of the files in the trust
/// directories (and one level below, for vomsdir's `<vo>/` directories).
fn trust_dirs_listing_digest(config: &TrustConfig) -> u64 {
    fn walk(dir: &Path, depth: u8, hasher: &mut DefaultHasher) {
        let Ok(entries) = fs::read_dir(dir) else {
            return;
        };
        let mut entries: Vec<_> = entries.filter_map(Result::ok).collect();
        entries.sort_by_key(|e| e.file_name());
        for entry in entries {
            entry.file_name().hash(hasher);
            if let Ok(meta) = entry.metadata() {
                meta.len().hash(hasher);
                meta.modified().ok().hash(hasher);
                if meta.is_dir() && depth > 0 {
                    walk(&entry.path(), depth - 1, hasher);
                }
            }
        }
    }
    let mut hasher = DefaultHasher::new();
    walk(&config.ca_dir, 0, &mut hasher);
    if let Some(vomsdir) = &config.vomsdir {
        walk(vomsdir, 1, &mut hasher);
    }
    hasher.finish()
}

fn credential_kind(kind: ProxyKind) -> CredentialKind {
    match kind {
        ProxyKind::EndEntity => CredentialKind::EndEntity,
        ProxyKind::Impersonation => CredentialKind::Impersonation,
        ProxyKind::Limited => CredentialKind::Limited,
        ProxyKind::Independent => CredentialKind::Independent,
    }
}

impl ClientAuthenticator for GridAuthenticator {
    fn authenticate(
        &self,
        chain: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<Identity, AuthError> {
        let Checked {
            verified,
            cas,
            vomsdir,
            now,
        } = self.verify_chain(chain, now)?;
        let dn = verified.identity.clone();
        for warning in &verified.warnings {
            self.warn_once(&dn, warning);
        }
        let mut vos = Vec::new();
        let mut fqans = Vec::new();
        if let Some(vomsdir) = &vomsdir {
            let (attributes, warnings) =
                ongrid_x509::voms::attributes(&verified, &cas, vomsdir, now);
            for warning in &warnings {
                self.warn_once(&dn, warning);
            }
            for attribute in attributes {
                vos.push(attribute.vo.clone());
                fqans.extend(attribute.fqans.iter().cloned());
            }
        } else if !verified.voms_der.is_empty() {
            self.warn_once(
                &dn,
                "the proxy carries VOMS attributes, but they are ignored: no vomsdir is configured",
            );
        }
        Ok(Identity {
            dn,
            kind: credential_kind(verified.kind),
            vos,
            fqans,
            not_after: verified.not_after,
            token: None,
        })
    }

    fn verify(&self, chain: &[CertificateDer<'_>], now: UnixTime) -> Result<(), AuthError> {
        self.verify_chain(chain, now).map(|_| ())
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &self.hints
    }
}

/// The rustls side of a [`ClientAuthenticator`]: offers client authentication, does not require
/// it, refuses the handshake when a presented chain does not verify, and checks the client's
/// handshake signature with the public key of the chain's first certificate.
#[derive(Debug)]
pub struct AuthenticatorVerifier {
    authenticator: Arc<dyn ClientAuthenticator>,
    algorithms: WebPkiSupportedAlgorithms,
}

impl AuthenticatorVerifier {
    pub fn new(authenticator: Arc<dyn ClientAuthenticator>, provider: &CryptoProvider) -> Self {
        Self {
            authenticator,
            algorithms: provider.signature_verification_algorithms,
        }
    }
}

/// The SubjectPublicKeyInfo (DER) of a certificate.
fn spki_of(cert: &CertificateDer<'_>) -> Result<Vec<u8>, rustls::Error> {
    let (_, parsed) = X509Certificate::from_der(cert.as_ref())
        .map_err(|_| rustls::Error::InvalidCertificate(CertificateError::BadEncoding))?;
    Ok(parsed.public_key().raw.to_vec())
}

impl ClientCertVerifier for AuthenticatorVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.authenticator.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let mut chain = Vec::with_capacity(intermediates.len() + 1);
        chain.push(end_entity.clone());
        chain.extend(intermediates.iter().cloned());
        match self.authenticator.verify(&chain, now) {
            Ok(()) => Ok(ClientCertVerified::assertion()),
            Err(error) => {
                tracing::info!(%error, "Client certificate refused in the TLS handshake.");
                Err(error.into_rustls())
            }
        }
    }

    /// TLS 1.2 names a scheme that may map to several algorithms: each is tried with the leaf's
    /// key, as rustls does for certificates webpki can parse.
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let unadvertised = || {
            rustls::Error::PeerMisbehaved(PeerMisbehaved::SignedHandshakeWithUnadvertisedSigScheme)
        };
        let algorithms = self
            .algorithms
            .mapping
            .iter()
            .find(|(scheme, _)| *scheme == dss.scheme)
            .map(|(_, algorithms)| *algorithms)
            .ok_or_else(unadvertised)?;
        let spki = spki_of(cert)?;
        let spki = SubjectPublicKeyInfoDer::from(spki.as_slice());
        let key = webpki::RawPublicKeyEntity::try_from(&spki)
            .map_err(|_| rustls::Error::InvalidCertificate(CertificateError::BadEncoding))?;
        for algorithm in algorithms {
            match key.verify_signature(*algorithm, message, dss.signature()) {
                Ok(()) => return Ok(HandshakeSignatureValid::assertion()),
                Err(webpki::Error::UnsupportedSignatureAlgorithmForPublicKeyContext(_)) => {}
                Err(_) => {
                    return Err(rustls::Error::InvalidCertificate(
                        CertificateError::BadSignature,
                    ))
                }
            }
        }
        Err(rustls::Error::InvalidCertificate(
            CertificateError::BadSignature,
        ))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let spki = spki_of(cert)?;
        rustls::crypto::verify_tls13_signature_with_raw_key(
            message,
            &SubjectPublicKeyInfoDer::from(spki.as_slice()),
            dss,
            &self.algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// The server side of TLS: certificate chain and key from the config, TLS 1.2 and 1.3, HTTP/2 and
/// HTTP/1.1 by ALPN, and client certificates checked by `authenticator`.
pub fn server_config(
    tls_cert: &Path,
    tls_key: &Path,
    authenticator: Arc<dyn ClientAuthenticator>,
    provider: Arc<CryptoProvider>,
) -> Result<ServerConfig, TlsMaterialError> {
    let chain = pem::read_certificates("tls_cert", tls_cert)?;
    let key = pem::read_private_key("tls_key", tls_key)?;
    let verifier = Arc::new(AuthenticatorVerifier::new(authenticator, &provider));
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(TlsMaterialError::ServerIdentity)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(TlsMaterialError::ServerIdentity)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{
        BasicConstraints, CertificateParams, DistinguishedName as RcDn, DnType, DnValue,
        ExtendedKeyUsagePurpose, IsCa, KeyPair,
    };

    struct Ca {
        cert: rcgen::Certificate,
        key: KeyPair,
    }

    fn ca(cn: &str) -> Ca {
        let mut params = CertificateParams::default();
        params.distinguished_name = RcDn::new();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Ca { cert, key }
    }

    fn user_cert(ca: &Ca, dn: RcDn) -> CertificateDer<'static> {
        let mut params = CertificateParams::default();
        params.distinguished_name = dn;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate().unwrap();
        params
            .signed_by(&key, &ca.cert, &ca.key)
            .unwrap()
            .der()
            .clone()
    }

    /// rcgen keeps one value per attribute type, so a single DC here.
    fn grid_dn(cn: &str) -> RcDn {
        let mut dn = RcDn::new();
        let dc = DnType::CustomDnType(vec![0, 9, 2342, 19200300, 100, 1, 25]);
        dn.push(dc, DnValue::Ia5String("org".try_into().unwrap()));
        dn.push(DnType::OrganizationName, "Example");
        dn.push(DnType::OrganizationalUnitName, "People");
        dn.push(DnType::CommonName, cn);
        dn
    }

    fn ca_dir(cas: &[&Ca]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (i, ca) in cas.iter().enumerate() {
            fs::write(dir.path().join(format!("0000000{i}.0")), ca.cert.pem()).unwrap();
        }
        // Files a real /etc/grid-security/certificates holds besides CAs are ignored.
        fs::write(
            dir.path().join("00000000.signing_policy"),
            "access_id_CA X509",
        )
        .unwrap();
        dir
    }

    fn trust(dir: &Path) -> TrustConfig {
        TrustConfig {
            ca_dir: dir.to_owned(),
            vomsdir: None,
            crl_policy: CrlPolicy::Refuse,
        }
    }

    #[test]
    fn only_certificates_from_the_ca_dir_authenticate() {
        let trusted = ca("Trusted CA");
        let stranger = ca("Unknown CA");
        let dir = ca_dir(&[&trusted]);
        let auth = GridAuthenticator::load(trust(dir.path())).unwrap();
        assert_eq!(auth.ca_count(), 1);
        let hint = auth.root_hint_subjects()[0].as_ref().to_vec();
        let (_, name) = x509_parser::x509::X509Name::from_der(&hint).unwrap();
        assert_eq!(name.to_string(), "CN=Trusted CA");

        let good = user_cert(&trusted, grid_dn("Alice Smith"));
        let identity = auth.authenticate(&[good], UnixTime::now()).unwrap();
        assert_eq!(
            identity.dn.as_str(),
            "/DC=org/O=Example/OU=People/CN=Alice Smith"
        );
        assert_eq!(identity.kind, CredentialKind::EndEntity);
        assert!(identity.fqans.is_empty());

        let bad = user_cert(&stranger, grid_dn("Mallory"));
        let err = auth.authenticate(&[bad], UnixTime::now()).unwrap_err();
        assert!(
            matches!(err, AuthError::Refused(ChainError::UnknownCa { .. })),
            "{err}"
        );
        assert!(matches!(
            err.into_rustls(),
            rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer)
        ));
        assert!(matches!(
            auth.authenticate(&[], UnixTime::now()),
            Err(AuthError::NoCertificate)
        ));
    }

    #[test]
    fn the_identity_expires_with_the_certificate() {
        let ca = ca("Test CA");
        let mut params = CertificateParams::default();
        params.distinguished_name = grid_dn("Alice Smith");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.not_after = rcgen::date_time_ymd(2031, 5, 17);
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &ca.cert, &ca.key).unwrap();
        let dir = ca_dir(&[&ca]);
        let auth = GridAuthenticator::load(trust(dir.path())).unwrap();
        let identity = auth
            .authenticate(&[cert.der().clone()], UnixTime::now())
            .unwrap();
        assert_eq!(identity.not_after.to_rfc3339(), "2031-05-17T00:00:00+00:00");
        // After that (and the five minutes of tolerated skew) it is refused as expired.
        let later = UnixTime::since_unix_epoch(Duration::from_secs(
            identity.not_after.timestamp() as u64 + 301,
        ));
        let err = auth.authenticate(&[cert.der().clone()], later).unwrap_err();
        assert!(matches!(
            err.into_rustls(),
            rustls::Error::InvalidCertificate(CertificateError::Expired)
        ));
    }

    #[test]
    fn a_changed_ca_dir_is_reloaded() {
        let first = ca("First CA");
        let second = ca("Second CA");
        let dir = ca_dir(&[&first]);
        let auth = GridAuthenticator::load(trust(dir.path()))
            .unwrap()
            .with_reload_check(Duration::ZERO);
        let cert = user_cert(&second, grid_dn("Bob"));
        assert!(auth
            .authenticate(std::slice::from_ref(&cert), UnixTime::now())
            .is_err());
        fs::write(dir.path().join("00000001.0"), second.cert.pem()).unwrap();
        let identity = auth
            .authenticate(std::slice::from_ref(&cert), UnixTime::now())
            .unwrap();
        assert_eq!(identity.dn.as_str(), "/DC=org/O=Example/OU=People/CN=Bob");
        // A directory emptied by mistake keeps the CAs loaded before.
        fs::remove_file(dir.path().join("00000000.0")).unwrap();
        fs::remove_file(dir.path().join("00000001.0")).unwrap();
        assert!(auth.authenticate(&[cert], UnixTime::now()).is_ok());
    }

    #[test]
    fn a_ca_dir_without_cas_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("0badf00d.0"), "no PEM here").unwrap();
        let err = GridAuthenticator::load(trust(dir.path())).unwrap_err();
        assert!(matches!(err, TlsMaterialError::CaDir(_)), "{err}");
        let err = GridAuthenticator::load(trust(&dir.path().join("missing"))).unwrap_err();
        assert!(err.to_string().starts_with("ca_dir "), "{err}");
    }

    #[test]
    fn server_config_loads_pem_files() {
        let ca = ca("Test CA");
        let dir = ca_dir(&[&ca]);
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec!["localhost".to_owned()])
            .unwrap()
            .signed_by(&key, &ca.cert, &ca.key)
            .unwrap();
        let cert_path = dir.path().join("server.crt");
        let key_path = dir.path().join("server.key");
        fs::write(&cert_path, cert.pem()).unwrap();
        fs::write(&key_path, key.serialize_pem()).unwrap();
        let auth = Arc::new(GridAuthenticator::load(trust(dir.path())).unwrap());
        let config = server_config(&cert_path, &key_path, auth.clone(), provider()).unwrap();
        assert_eq!(config.alpn_protocols[0], b"h2");
        let err = server_config(&cert_path, &cert_path, auth, provider()).unwrap_err();
        assert!(err.to_string().contains("tls_key"), "{err}");
    }
}
