// keypeer: sigstore key files and signatures handled with Go's own crypto (crypto/ecdsa, x509,
// golang.org/x/crypto scrypt and nacl/secretbox), the stack cosign and containers/image build on.
// The tests use it as the other side for diskkit's key format, because Debian's skopeo 1.9 has
// sigstore compiled out. Envelope layout: go-securesystemslib's encrypted package (JSON, []byte
// fields in standard base64).
//
//	keypeer keygen PREFIX PASSFILE      writes PREFIX.private, PREFIX.pub
//	keypeer sign KEY PASSFILE < payload  prints the base64 ASN.1 signature
//	keypeer verify PUB SIGB64 < payload  exits 0 when it verifies
package main

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/crypto/nacl/secretbox"
	"golang.org/x/crypto/scrypt"
)

type envelope struct {
	KDF struct {
		Name   string `json:"name"`
		Params struct {
			N int `json:"N"`
			R int `json:"r"`
			P int `json:"p"`
		} `json:"params"`
		Salt []byte `json:"salt"`
	} `json:"kdf"`
	Cipher struct {
		Name  string `json:"name"`
		Nonce []byte `json:"nonce"`
	} `json:"cipher"`
	Ciphertext []byte `json:"ciphertext"`
}

func passphrase(path string) []byte {
	data, err := os.ReadFile(path)
	check(err)
	return bytes.SplitN(data, []byte("\n"), 2)[0]
}

func boxKey(pass, salt []byte, n, r, p int) *[32]byte {
	k, err := scrypt.Key(pass, salt, n, r, p, 32)
	check(err)
	var key [32]byte
	copy(key[:], k)
	return &key
}

func keygen(prefix, passFile string) {
	priv, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	check(err)
	der, err := x509.MarshalPKCS8PrivateKey(priv)
	check(err)
	var env envelope
	env.KDF.Name, env.Cipher.Name = "scrypt", "nacl/secretbox"
	env.KDF.Params.N, env.KDF.Params.R, env.KDF.Params.P = 32768, 8, 1
	env.KDF.Salt = make([]byte, 32)
	env.Cipher.Nonce = make([]byte, 24)
	_, err = rand.Read(env.KDF.Salt)
	check(err)
	_, err = rand.Read(env.Cipher.Nonce)
	check(err)
	var nonce [24]byte
	copy(nonce[:], env.Cipher.Nonce)
	env.Ciphertext = secretbox.Seal(nil, der, &nonce, boxKey(passphrase(passFile), env.KDF.Salt, 32768, 8, 1))
	body, err := json.Marshal(env)
	check(err)
	check(os.WriteFile(prefix+".private", pem.EncodeToMemory(&pem.Block{Type: "ENCRYPTED SIGSTORE PRIVATE KEY", Bytes: body}), 0o600))
	pub, err := x509.MarshalPKIXPublicKey(priv.Public())
	check(err)
	check(os.WriteFile(prefix+".pub", pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub}), 0o644))
}

func sign(keyFile, passFile string) {
	data, err := os.ReadFile(keyFile)
	check(err)
	block, _ := pem.Decode(data)
	if block == nil || (block.Type != "ENCRYPTED COSIGN PRIVATE KEY" && block.Type != "ENCRYPTED SIGSTORE PRIVATE KEY") {
		check(errors.New("not an encrypted sigstore private key"))
	}
	var env envelope
	check(json.Unmarshal(block.Bytes, &env))
	if env.KDF.Name != "scrypt" || env.Cipher.Name != "nacl/secretbox" || len(env.Cipher.Nonce) != 24 {
		check(fmt.Errorf("unexpected envelope %s/%s", env.KDF.Name, env.Cipher.Name))
	}
	var nonce [24]byte
	copy(nonce[:], env.Cipher.Nonce)
	der, ok := secretbox.Open(nil, env.Ciphertext, &nonce, boxKey(passphrase(passFile), env.KDF.Salt, env.KDF.Params.N, env.KDF.Params.R, env.KDF.Params.P))
	if !ok {
		check(errors.New("decrypt: wrong passphrase"))
	}
	key, err := x509.ParsePKCS8PrivateKey(der)
	check(err)
	payload, err := io.ReadAll(os.Stdin)
	check(err)
	sum := sha256.Sum256(payload)
	sig, err := ecdsa.SignASN1(rand.Reader, key.(*ecdsa.PrivateKey), sum[:])
	check(err)
	fmt.Println(base64.StdEncoding.EncodeToString(sig))
}

func verify(pubFile, sigB64 string) {
	data, err := os.ReadFile(pubFile)
	check(err)
	block, _ := pem.Decode(data)
	if block == nil || block.Type != "PUBLIC KEY" {
		check(errors.New("not a PUBLIC KEY PEM"))
	}
	pub, err := x509.ParsePKIXPublicKey(block.Bytes)
	check(err)
	sig, err := base64.StdEncoding.DecodeString(sigB64)
	check(err)
	payload, err := io.ReadAll(os.Stdin)
	check(err)
	sum := sha256.Sum256(payload)
	if !ecdsa.VerifyASN1(pub.(*ecdsa.PublicKey), sum[:], sig) {
		check(errors.New("signature does not verify"))
	}
}

func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "keypeer:", err)
		os.Exit(1)
	}
}

func main() {
	if len(os.Args) != 4 {
		check(errors.New("usage: keypeer keygen PREFIX PASSFILE | sign KEY PASSFILE | verify PUB SIGB64"))
	}
	switch os.Args[1] {
	case "keygen":
		keygen(os.Args[2], os.Args[3])
	case "sign":
		sign(os.Args[2], os.Args[3])
	case "verify":
		verify(os.Args[2], os.Args[3])
	default:
		check(errors.New("unknown command " + os.Args[1]))
	}
}
