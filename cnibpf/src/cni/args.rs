//! `CNI_ARGS` as runtimes set it: `K=V` pairs separated by `;`, read as libcni's `LoadArgs`
//! reads them. containerd and CRI-O send
//! `IgnoreUnknown=1;K8S_POD_NAMESPACE=…;K8S_POD_NAME=…;K8S_POD_INFRA_CONTAINER_ID=…;K8S_POD_UID=…`;
//! a key cnibpf does not know is an error unless `IgnoreUnknown` is true.

use crate::model::attachment::Pod;

/// Longest pod namespace kept (a Kubernetes namespace is a DNS label, at most 63 bytes).
pub const POD_NAMESPACE_MAX: usize = cnibpf_common::endpoints::owners::POD_NAMESPACE_LEN - 1;
/// Longest pod name kept (a DNS subdomain, at most 253 bytes).
pub const POD_NAME_MAX: usize = cnibpf_common::endpoints::owners::POD_NAME_LEN - 1;

/// The arguments cnibpf reads from `CNI_ARGS`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CniArgs {
    pub pod: Option<Pod>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ArgsError {
    #[error("CNI_ARGS: invalid pair {0:?}, expected KEY=VALUE")]
    Pair(String),
    #[error("CNI_ARGS: IgnoreUnknown={0:?} is not a boolean (1, 0, true or false)")]
    IgnoreUnknown(String),
    #[error(
        "CNI_ARGS: unknown args {0:?} (cnibpf reads K8S_POD_NAMESPACE, K8S_POD_NAME, K8S_POD_INFRA_CONTAINER_ID and K8S_POD_UID; set IgnoreUnknown=1 to pass others)"
    )]
    Unknown(Vec<String>),
}

const KNOWN: [&str; 5] = [
    "IgnoreUnknown",
    "K8S_POD_NAMESPACE",
    "K8S_POD_NAME",
    "K8S_POD_INFRA_CONTAINER_ID",
    "K8S_POD_UID",
];

impl CniArgs {
    pub fn parse(text: &str) -> Result<Self, ArgsError> {
        let mut pairs = Vec::new();
        for pair in text.split(';').filter(|pair| !pair.is_empty()) {
            let mut parts = pair.split('=');
            match (parts.next(), parts.next(), parts.next()) {
                (Some(key), Some(value), None) => pairs.push((key, value)),
                _ => return Err(ArgsError::Pair(pair.to_owned())),
            }
        }
        let ignore_unknown = match pairs.iter().find(|(key, _)| *key == "IgnoreUnknown") {
            None => false,
            Some((_, value)) => match value.to_ascii_lowercase().as_str() {
                "1" | "true" => true,
                "0" | "false" => false,
                _ => return Err(ArgsError::IgnoreUnknown((*value).to_owned())),
            },
        };
        let unknown: Vec<String> = pairs
            .iter()
            .filter(|(key, _)| !KNOWN.contains(key))
            .map(|(key, _)| (*key).to_owned())
            .collect();
        if !unknown.is_empty() && !ignore_unknown {
            return Err(ArgsError::Unknown(unknown));
        }
        let value = |wanted: &str| {
            pairs
                .iter()
                .rev()
                .find(|(key, _)| *key == wanted)
                .map(|(_, value)| *value)
                .filter(|value| !value.is_empty())
        };
        let pod = match (value("K8S_POD_NAMESPACE"), value("K8S_POD_NAME")) {
            (Some(namespace), Some(name)) => Some(Pod {
                namespace: truncate(namespace, POD_NAMESPACE_MAX),
                name: truncate(name, POD_NAME_MAX),
            }),
            _ => None,
        };
        Ok(Self { pod })
    }
}

/// At most `max` bytes of `text`, cut at a character boundary: the pod is shown, never
/// matched on, and a runtime's over-long name must not fail an ADD.
fn truncate(text: &str, max: usize) -> String {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn containerd_and_cri_o_args() {
        let args = CniArgs::parse(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=1234",
        )
        .expect("valid");
        assert_eq!(
            args.pod,
            Some(Pod {
                namespace: "default".to_owned(),
                name: "web-0".to_owned()
            })
        );
        assert_eq!(args.pod.expect("pod").to_string(), "default/web-0");
        assert_eq!(CniArgs::parse("").expect("empty"), CniArgs::default());
    }

    #[test]
    fn unknown_args_follow_ignore_unknown() {
        assert_eq!(
            CniArgs::parse("FOO=bar"),
            Err(ArgsError::Unknown(vec!["FOO".to_owned()]))
        );
        assert!(CniArgs::parse("FOO=bar;IgnoreUnknown=true").is_ok());
        assert!(CniArgs::parse("IgnoreUnknown=TRUE;FOO=bar").is_ok());
        assert_eq!(
            CniArgs::parse("IgnoreUnknown=0;FOO=bar"),
            Err(ArgsError::Unknown(vec!["FOO".to_owned()]))
        );
        assert_eq!(
            CniArgs::parse("IgnoreUnknown=yes"),
            Err(ArgsError::IgnoreUnknown("yes".to_owned()))
        );
        assert_eq!(
            CniArgs::parse("K8S_POD_NAME"),
            Err(ArgsError::Pair("K8S_POD_NAME".to_owned()))
        );
        assert_eq!(
            CniArgs::parse("A=b=c;IgnoreUnknown=1"),
            Err(ArgsError::Pair("A=b=c".to_owned()))
        );
    }

    #[test]
    fn a_pod_needs_both_names_and_long_names_are_cut() {
        assert_eq!(CniArgs::parse("K8S_POD_NAME=x").expect("valid").pod, None);
        let long = "é".repeat(200);
        let pod = CniArgs::parse(&format!("K8S_POD_NAMESPACE=ns;K8S_POD_NAME={long}"))
            .expect("valid")
            .pod
            .expect("pod");
        assert!(pod.name.len() <= POD_NAME_MAX && pod.name.chars().all(|c| c == 'é'));
    }
}
