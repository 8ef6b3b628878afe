//! TLS for the API: the server certificate, and client certificates turned into an [`Identity`].
//!
//! Client authentication sits behind one trait, [`ClientAuthenticator`]: it checks a presented
//! chain and names the subject. [`CaDirAuthenticator`] is today's implementation (plain X.509
//! certificates from the CAs in `ca_dir`, checked by webpki); grid proxy certificates (RFC 3820)
//! will come as another implementation of the same trait, and nothing else changes.
//!
//! [`AuthenticatorVerifier`] plugs an authenticator into rustls. A client certificate is optional
//! (agents authenticate with bearer tokens instead), but one that is presented must verify: if not,
//! the handshake fails with a TLS alert, which devctl reports as "certificate refused".

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use ongrid_core::Dn;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::WebPkiClientVerifier;
use rustls::{
    CertificateError, DigitallySignedStruct, DistinguishedName, RootCertStore, ServerConfig,
    SignatureScheme,
};
use x509_parser::prelude::{FromDer, X509Certificate};
use x509_parser::x509::X509Name;

/// Who is on the other end of a connection that presented a valid client certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The subject DN of the end-entity certificate, in slash form.
    pub dn: Dn,
    /// Until when the credential is valid: the end-entity certificate's notAfter (for a proxy
    /// chain, the earliest notAfter of the chain). SSH keys registered with it expire then.
    pub not_after: DateTime<Utc>,
}

/// Why a client certificate chain was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("no client certificate was presented")]
    NoCertificate,
    #[error("client certificate refused: {0}")]
    Refused(#[source] rustls::Error),
    #[error("client certificate subject or validity cannot be read: {0}")]
    BadSubject(String),
}

impl AuthError {
    /// The rustls error that makes the handshake fail with the matching alert.
    fn into_rustls(self) -> rustls::Error {
        match self {
            Self::Refused(error) => error,
            Self::NoCertificate | Self::BadSubject(_) => {
                rustls::Error::InvalidCertificate(CertificateError::BadEncoding)
            }
        }
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

    /// Subjects of the trusted CAs, sent to clients as a hint of which certificate to present.
    fn root_hint_subjects(&self) -> &[DistinguishedName];
}

/// Why the TLS material could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {key} {}: {source}", path.display())]
    Read {
        key: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{key} {} holds no {what}: it must be PEM", path.display())]
    Empty {
        key: &'static str,
        path: PathBuf,
        what: &'static str,
    },
    #[error("ca_dir {} holds no CA certificate (IGTF layout: <hash>.0 PEM files)", path.display())]
    NoCas { path: PathBuf },
    #[error("building the client certificate verifier for ca_dir {}: {message}", path.display())]
    Verifier { path: PathBuf, message: String },
    #[error("tls_cert and tls_key do not make a usable server identity: {0}")]
    ServerIdentity(#[source] rustls::Error),
}

/// The one crypto provider the manager uses (ring), passed explicitly so that which provider
/// other crates enable in the same process does not matter.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Accepts client certificates issued (directly or through intermediates the client sends) by a
/// CA found in an IGTF-style directory (`<subject-hash>.0` ... `.9` PEM files).
///
/// CRLs (`<hash>.r0`) are not read yet: revocation comes with the proxy-aware authenticator.
pub struct CaDirAuthenticator {
    dir: PathBuf,
    ca_count: usize,
    verifier: Arc<dyn ClientCertVerifier>,
}

impl fmt::Debug for CaDirAuthenticator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CaDirAuthenticator")
            .field("dir", &self.dir)
            .field("ca_count", &self.ca_count)
            .finish_non_exhaustive()
    }
}

impl CaDirAuthenticator {
    /// Loads every `*.0`..`*.9` PEM file of `dir`. A file that does not parse is skipped with a
    /// warning (one bad CA file must not lock every user out); a directory with no CA at all is
    /// an error.
    pub fn load(dir: &Path, provider: Arc<CryptoProvider>) -> Result<Self, TlsError> {
        let entries = fs::read_dir(dir).map_err(|source| TlsError::Read {
            key: "ca_dir",
            path: dir.to_owned(),
            source,
        })?;
        let mut paths: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .map(|entry| entry.path())
            .filter(|path| is_ca_file_name(path))
            .collect();
        paths.sort();
        let mut roots = RootCertStore::empty();
        for path in &paths {
            let pem = match fs::read(path) {
                Ok(pem) => pem,
                Err(error) => {
                    tracing::warn!(path = %path.display(), %error, "Skipping unreadable CA file.");
                    continue;
                }
            };
            let certs: Vec<_> = rustls_pemfile::certs(&mut pem.as_slice())
                .filter_map(Result::ok)
                .collect();
            if certs.is_empty() {
                tracing::warn!(path = %path.display(), "Skipping CA file without a PEM certificate.");
                continue;
            }
            let (added, ignored) = roots.add_parsable_certificates(certs);
            if ignored > 0 {
                tracing::warn!(path = %path.display(), added, ignored, "Skipping unparsable CA certificates.");
            }
        }
        if roots.is_empty() {
            return Err(TlsError::NoCas {
                path: dir.to_owned(),
            });
        }
        let ca_count = roots.len();
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
            .allow_unauthenticated()
            .build()
            .map_err(|e| TlsError::Verifier {
                path: dir.to_owned(),
                message: e.to_string(),
            })?;
        tracing::info!(dir = %dir.display(), ca_count, "Loaded client CAs.");
        Ok(Self {
            dir: dir.to_owned(),
            ca_count,
            verifier,
        })
    }

    /// How many CA certificates were loaded.
    pub fn ca_count(&self) -> usize {
        self.ca_count
    }
}

/// `<anything>.0` to `<anything>.9`: the IGTF names of CA certificates (CRLs are `.r0`).
fn is_ca_file_name(path: &Path) -> bool {
    path.is_file()
        && path
            .extension()
            .and_then(|ext| ext.to_str())
            .is_some_and(|ext| ext.len() == 1 && ext.as_bytes()[0].is_ascii_digit())
}

impl ClientAuthenticator for CaDirAuthenticator {
    fn authenticate(
        &self,
        chain: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<Identity, AuthError> {
        let (end_entity, intermediates) = chain.split_first().ok_or(AuthError::NoCertificate)?;
        self.verifier
            .verify_client_cert(end_entity, intermediates, now)
            .map_err(AuthError::Refused)?;
        end_entity_identity(end_entity).map_err(AuthError::BadSubject)
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.verifier.root_hint_subjects()
    }
}

/// The rustls side of a [`ClientAuthenticator`]: offers client authentication, does not require
/// it, and refuses the handshake when a presented chain does not authenticate.
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
        self.authenticator
            .authenticate(&chain, now)
            .map(|_| ClientCertVerified::assertion())
            .map_err(AuthError::into_rustls)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
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
) -> Result<ServerConfig, TlsError> {
    let chain = load_certs("tls_cert", tls_cert)?;
    let key = load_key(tls_key)?;
    let verifier = Arc::new(AuthenticatorVerifier::new(authenticator, &provider));
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(TlsError::ServerIdentity)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(TlsError::ServerIdentity)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

fn read(key: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    fs::read(path).map_err(|source| TlsError::Read {
        key,
        path: path.to_owned(),
        source,
    })
}

fn load_certs(key: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(key, path)?;
    let certs = rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Read {
            key,
            path: path.to_owned(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            key,
            path: path.to_owned(),
            what: "certificate",
        });
    }
    Ok(certs)
}

fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read("tls_key", path)?;
    rustls_pemfile::private_key(&mut pem.as_slice())
        .map_err(|source| TlsError::Read {
            key: "tls_key",
            path: path.to_owned(),
            source,
        })?
        .ok_or_else(|| TlsError::Empty {
            key: "tls_key",
            path: path.to_owned(),
            what: "private key",
        })
}

/// The subject DN and notAfter of a DER certificate.
pub fn end_entity_identity(cert: &CertificateDer<'_>) -> Result<Identity, String> {
    let (_, parsed) = X509Certificate::from_der(cert.as_ref()).map_err(|e| e.to_string())?;
    let dn = name_to_dn(parsed.subject())?;
    let seconds = parsed.validity().not_after.timestamp();
    let not_after = DateTime::from_timestamp(seconds, 0)
        .ok_or_else(|| format!("the certificate's notAfter ({seconds} s) is out of range"))?;
    Ok(Identity { dn, not_after })
}

/// The subject of a DER certificate as a slash-form DN, RDNs in the order they are encoded.
pub fn subject_dn(cert: &CertificateDer<'_>) -> Result<Dn, String> {
    let (_, parsed) = X509Certificate::from_der(cert.as_ref()).map_err(|e| e.to_string())?;
    name_to_dn(parsed.subject())
}

/// `X509Name` → `/KEY=value/...` with OpenSSL's short names; a multi-valued RDN is joined with
/// `+`; an attribute without a known short name is written as its dotted OID.
pub fn name_to_dn(name: &X509Name<'_>) -> Result<Dn, String> {
    let mut out = String::new();
    for rdn in name.iter_rdn() {
        out.push('/');
        for (i, attribute) in rdn.iter().enumerate() {
            if i > 0 {
                out.push('+');
            }
            let oid = attribute.attr_type().to_id_string();
            out.push_str(short_name(&oid).unwrap_or(&oid));
            out.push('=');
            let value = match attribute.as_str() {
                Ok(text) => text.to_owned(),
                // BMPString and other encodings x509-parser does not turn into &str.
                Err(_) => String::from_utf8_lossy(attribute.attr_value().data).into_owned(),
            };
            out.push_str(&value);
        }
    }
    if out.is_empty() {
        return Err("the certificate has an empty subject".to_owned());
    }
    Dn::parse(&out).map_err(|e| e.to_string())
}

fn short_name(oid: &str) -> Option<&'static str> {
    Some(match oid {
        "2.5.4.6" => "C",
        "2.5.4.8" => "ST",
        "2.5.4.7" => "L",
        "2.5.4.10" => "O",
        "2.5.4.11" => "OU",
        "2.5.4.3" => "CN",
        "2.5.4.5" => "serialNumber",
        "0.9.2342.19200300.100.1.25" => "DC",
        "0.9.2342.19200300.100.1.1" => "UID",
        "1.2.840.113549.1.9.1" => "emailAddress",
        _ => return None,
    })
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
            fs::write(dir.path().join(format!("ca{i}.0")), ca.cert.pem()).unwrap();
        }
        // Files a real /etc/grid-security/certificates holds besides CAs are ignored.
        fs::write(dir.path().join("ca0.r0"), "not a CRL parser yet").unwrap();
        fs::write(dir.path().join("ca0.signing_policy"), "access_id_CA X509").unwrap();
        dir
    }

    #[test]
    fn dn_keeps_rdn_order_and_short_names() {
        let ca = ca("Test CA");
        let cert = user_cert(&ca, grid_dn("Alice Smith"));
        let dn = subject_dn(&cert).unwrap();
        assert_eq!(dn.as_str(), "/DC=org/O=Example/OU=People/CN=Alice Smith");
    }

    #[test]
    fn unknown_attributes_are_dotted_oids() {
        let ca = ca("Test CA");
        let mut dn = RcDn::new();
        dn.push(DnType::CountryName, "UK");
        dn.push(DnType::CustomDnType(vec![1, 2, 3, 4]), "x");
        dn.push(DnType::CommonName, "Bob");
        let cert = user_cert(&ca, dn);
        assert_eq!(
            subject_dn(&cert).unwrap().as_str(),
            "/C=UK/1.2.3.4=x/CN=Bob"
        );
    }

    #[test]
    fn only_certificates_from_the_ca_dir_authenticate() {
        let trusted = ca("Trusted CA");
        let stranger = ca("Unknown CA");
        let dir = ca_dir(&[&trusted]);
        let auth = CaDirAuthenticator::load(dir.path(), provider()).unwrap();
        assert_eq!(auth.ca_count(), 1);
        assert_eq!(auth.root_hint_subjects().len(), 1);

        let good = user_cert(&trusted, grid_dn("Alice Smith"));
        let identity = auth.authenticate(&[good], UnixTime::now()).unwrap();
        assert_eq!(
            identity.dn.as_str(),
            "/DC=org/O=Example/OU=People/CN=Alice Smith"
        );

        let bad = user_cert(&stranger, grid_dn("Mallory"));
        let err = auth.authenticate(&[bad], UnixTime::now()).unwrap_err();
        assert!(
            matches!(
                err,
                AuthError::Refused(rustls::Error::InvalidCertificate(
                    CertificateError::UnknownIssuer
                ))
            ),
            "{err}"
        );
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
        let auth = CaDirAuthenticator::load(dir.path(), provider()).unwrap();
        let identity = auth
            .authenticate(&[cert.der().clone()], UnixTime::now())
            .unwrap();
        assert_eq!(identity.not_after.to_rfc3339(), "2031-05-17T00:00:00+00:00");
    }

    #[test]
    fn a_ca_dir_without_cas_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("junk.0"), "no PEM here").unwrap();
        let err = CaDirAuthenticator::load(dir.path(), provider()).unwrap_err();
        assert!(matches!(err, TlsError::NoCas { .. }), "{err}");
        let err = CaDirAuthenticator::load(&dir.path().join("missing"), provider()).unwrap_err();
        assert!(err.to_string().starts_with("reading ca_dir"), "{err}");
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
        let auth = Arc::new(CaDirAuthenticator::load(dir.path(), provider()).unwrap());
        let config = server_config(&cert_path, &key_path, auth.clone(), provider()).unwrap();
        assert_eq!(config.alpn_protocols[0], b"h2");
        let err = server_config(&cert_path, &cert_path, auth, provider()).unwrap_err();
        assert!(err.to_string().contains("tls_key"), "{err}");
    }
}
