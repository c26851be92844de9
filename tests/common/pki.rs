//! A throwaway PKI for TLS tests: a CA generated in the test and the
//! certificates it signs, written as PEM files.

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};

pub struct Pki {
    dir: PathBuf,
    name: String,
    ca: CertifiedIssuer<'static, KeyPair>,
}

impl Pki {
    /// A new CA named `name`; its certificate is `<dir>/<name>-ca.pem`.
    pub fn new(dir: &Path, name: &str) -> Pki {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, format!("{name} test CA"));
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let pki = Pki {
            dir: dir.to_owned(),
            name: name.to_string(),
            ca,
        };
        std::fs::write(pki.ca_file(), pki.ca.pem()).unwrap();
        pki
    }

    pub fn ca_file(&self) -> PathBuf {
        self.dir.join(format!("{}-ca.pem", self.name))
    }

    /// Issues a certificate for `names` (DNS names or IP addresses); returns
    /// the certificate and key files.
    pub fn issue(&self, who: &str, names: &[&str]) -> (PathBuf, PathBuf) {
        let key = KeyPair::generate().unwrap();
        let params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap();
        let cert = params.signed_by(&key, &self.ca).unwrap();
        let cert_file = self.dir.join(format!("{}-{who}.pem", self.name));
        let key_file = self.dir.join(format!("{}-{who}.key", self.name));
        std::fs::write(&cert_file, cert.pem()).unwrap();
        std::fs::write(&key_file, key.serialize_pem()).unwrap();
        (cert_file, key_file)
    }

    /// A Redis/Valkey server's arguments for a TLS port (returned too)
    /// beside its plain one, with a certificate from this CA for
    /// `127.0.0.1`, as production runs it: it asks every client for a
    /// certificate (`tls-auth-clients yes`) and replicates over TLS
    /// (`tls-replication yes`).
    pub fn server_tls(&self, who: &str) -> (Vec<String>, u16) {
        let (cert, key) = self.issue(who, &["127.0.0.1"]);
        let port = super::kv::free_port();
        let args = [
            "--tls-port",
            &port.to_string(),
            "--tls-cert-file",
            &cert.display().to_string(),
            "--tls-key-file",
            &key.display().to_string(),
            "--tls-ca-cert-file",
            &self.ca_file().display().to_string(),
            "--tls-auth-clients",
            "yes",
            "--tls-replication",
            "yes",
        ]
        .map(str::to_string);
        (args.to_vec(), port)
    }

    /// A Sentinel's `sentinel.conf` lines for a TLS port (returned too)
    /// beside its plain one, as [`Pki::server_tls`] gives a server: it
    /// reaches servers and other Sentinels over TLS.
    pub fn sentinel_tls(&self, who: &str) -> (String, u16) {
        let (args, port) = self.server_tls(who);
        let lines = args
            .chunks(2)
            .map(|kv| format!("{} {}\n", kv[0].trim_start_matches("--"), kv[1]))
            .collect();
        (lines, port)
    }

    /// `[redis]` settings that reach the servers over TLS with this CA,
    /// and present a fresh certificate for `who` (to servers that ask for
    /// one, and on the seed and feed ports).
    pub fn redis_tls(&self, who: &str) -> String {
        let (cert, key) = self.issue(who, &["kvsync-agent"]);
        format!(
            "tls = true\ntls_ca_file = \"{}\"\ntls_cert_file = \"{}\"\ntls_key_file = \"{}\"\n",
            self.ca_file().display(),
            cert.display(),
            key.display()
        )
    }

    /// An agent's `[tls]` section with a fresh certificate for `who` on
    /// this host (`localhost`, `127.0.0.1`) and this CA.
    pub fn agent_tls(&self, who: &str) -> String {
        let (cert, key) = self.issue(who, &["localhost", "127.0.0.1"]);
        format!(
            "[tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\nca_file = \"{}\"\n",
            cert.display(),
            key.display(),
            self.ca_file().display()
        )
    }
}
