//! A certificate authority and the certificates gpuledger's components present, for the local
//! cluster, the tests and the benchmarks (a cluster uses cert-manager or
//! `deploy/scripts/gpuledger-certs.sh`, which issue the same shapes).

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    SanType,
};

use crate::identity::{Role, spiffe_id};

/// A CA that signs server and client certificates.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    pem: String,
}

/// A certificate and its key, PEM.
pub struct Leaf {
    /// The certificate.
    pub cert_pem: String,
    /// Its private key.
    pub key_pem: String,
}

impl Leaf {
    /// Write `<name>.crt` and `<name>.key` into `dir`; the paths.
    pub fn write(&self, dir: &Path, name: &str) -> std::io::Result<(PathBuf, PathBuf)> {
        let (c, k) = (
            dir.join(format!("{name}.crt")),
            dir.join(format!("{name}.key")),
        );
        std::fs::write(&c, &self.cert_pem)?;
        std::fs::write(&k, &self.key_pem)?;
        Ok((c, k))
    }
}

impl Ca {
    /// A new self-signed CA called `name`.
    pub fn new(name: &str) -> Result<Self, rcgen::Error> {
        let mut p = CertificateParams::new(Vec::<String>::new())?;
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate()?;
        let pem = p.self_signed(&key)?.pem();
        Ok(Ca {
            issuer: Issuer::new(p, key),
            pem,
        })
    }

    /// An existing CA from its certificate and private key (PEM), e.g. the one
    /// `deploy/scripts/gpuledger-certs.sh` made, to issue more certificates of the same trust.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self, rcgen::Error> {
        let key = KeyPair::from_pem(key_pem)?;
        Ok(Ca {
            issuer: Issuer::from_ca_cert_pem(cert_pem, key)?,
            pem: cert_pem.to_string(),
        })
    }

    /// The CA certificate, PEM (what clients and servers trust).
    pub fn pem(&self) -> String {
        self.pem.clone()
    }

    /// Write the CA certificate to `path`.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        std::fs::write(path, self.pem())
    }

    /// A server certificate for these host names and IP addresses.
    pub fn server(&self, hosts: &[&str]) -> Result<Leaf, rcgen::Error> {
        let mut p =
            CertificateParams::new(hosts.iter().map(|h| h.to_string()).collect::<Vec<_>>())?;
        p.distinguished_name.push(
            DnType::CommonName,
            hosts.first().copied().unwrap_or("server"),
        );
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.sign(p)
    }

    /// A client certificate naming `role` (and operator `name`) in its SPIFFE URI SAN.
    pub fn client(&self, role: &Role, name: &str) -> Result<Leaf, rcgen::Error> {
        let id = spiffe_id(role, name);
        let mut p = CertificateParams::new(Vec::<String>::new())?;
        p.subject_alt_names = vec![SanType::URI(id.as_str().try_into()?)];
        p.distinguished_name.push(DnType::CommonName, id.as_str());
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(p)
    }

    /// A certificate good for both ends (etcd members talk to each other with one).
    pub fn peer(&self, hosts: &[&str], common_name: &str) -> Result<Leaf, rcgen::Error> {
        let mut p =
            CertificateParams::new(hosts.iter().map(|h| h.to_string()).collect::<Vec<_>>())?;
        p.distinguished_name.push(DnType::CommonName, common_name);
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        self.sign(p)
    }

    fn sign(&self, p: CertificateParams) -> Result<Leaf, rcgen::Error> {
        let key = KeyPair::generate()?;
        let cert = p.signed_by(&key, &self.issuer)?;
        Ok(Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}
